"""allowed_token_ids kept on the sampling worker (executors/allowed_token_masks.py): each
request's ids become a device mask once per admission, not once per step, and decoding
stays the masked reference's (Hugging Face's logits with every other token at -inf, greedy)
over many steps and across preemption by recompute, on the CPU's path and a GPU's path
(forced on the CPU: penalties on the device, deferred reads)."""

from __future__ import annotations

import pytest

from engine_checks import assert_engine_idle
from test_sampler_host_reads import gpu_path  # noqa: F401 (a fixture)
from test_token_masks import sampling_path  # noqa: F401 (a fixture)
from tiny_models import random_prompts
from token_mask_reference import assert_masked_greedy

from raylm.engine import LLM, SamplingParams

# Spread over the tiny vocabulary (512), as test_token_masks's.
ALLOWED = [3, 17, 40, 99, 123, 200, 256, 301, 377, 402, 450, 511]
MAX_TOKENS = 24


def test_masks_are_built_once_per_admission_and_hold_across_preemption(llama_dir, sampling_path):  # noqa: F811
    # 8 prompts of ~30 tokens growing to ~54 need 4 blocks each; 14 blocks force the
    # scheduler to preempt and recompute. Every other request is masked, two sets of ids.
    llm = LLM(model=str(llama_dir), dtype="float32", num_gpu_blocks_override=14, max_model_len=128,
              max_num_seqs=8)
    try:
        prompts = random_prompts(8, seed=7, min_len=20, max_len=40)
        allowed = [ALLOWED if i % 4 == 0 else ALLOWED[3:9] if i % 4 == 2 else None for i in range(len(prompts))]
        params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, allowed_token_ids=ids)
                  for ids in allowed]
        masks = llm.llm_engine.executor.driver_worker.model_runner.allowed_token_masks
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        preemptions = llm.llm_engine.scheduler.num_preemptions
        assert preemptions > 0
        for prompt, ids, output in zip(prompts, allowed, outputs):
            tokens = list(output.outputs[0].token_ids)
            assert len(tokens) == MAX_TOKENS
            if ids is not None:
                assert_masked_greedy(llama_dir, prompt, tokens, allowed=ids, what=f"{sampling_path}: {ids}")
        masked = sum(ids is not None for ids in allowed)
        # One mask per admission (at most one per preemption on top), not one per step
        # (masked * MAX_TOKENS = 96 sampled steps).
        assert masked <= masks.num_built <= masked + preemptions
        assert len(masks) == 0  # all dropped with their requests
        assert_engine_idle(llm.llm_engine)
    finally:
        llm.shutdown()


def test_the_masks_read_nothing_back_and_later_steps_send_no_ids(gpu_path):  # noqa: F811
    """On a GPU's path (forced on the CPU) the masks read nothing back from the device, and
    a request's second step reuses the mask its first built."""
    import torch

    from test_sampler_host_reads import VOCAB, HostReads

    from raylm.executors.allowed_token_masks import AllowedTokenMasks
    from raylm.executors.sampler import Sampler
    from raylm.executors.sampling_metadata import SamplingMetadata

    masks = AllowedTokenMasks(torch.device("cpu"))
    params = [SamplingParams(temperature=0.0, allowed_token_ids=[5, 9, 60]),
              SamplingParams(temperature=0.8, seed=1, allowed_token_ids=[2, 3]),
              SamplingParams(temperature=0.0)]
    for step in range(2):
        logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(step))
        metadata = SamplingMetadata.from_params(params, [[1, 2]] * 3, [[3], [4], [5]], req_ids=[10, 11, 12])
        metadata.allowed_token_masks = masks
        with HostReads() as counter:
            tokens = Sampler()(logits.clone(), metadata)
        assert counter.reads == ["tolist"]  # the step's one read of its tokens
        assert tokens[0].token_id == max([5, 9, 60], key=lambda t: logits[0, t])
        assert tokens[1].token_id in (2, 3)
        assert tokens[2].token_id == int(logits[2].argmax())
        assert masks.num_built == 2 and len(masks) == 2
    masks.release([10, 11])
    assert len(masks) == 0


def test_no_mask_is_held_once_masked_requests_finish_or_are_aborted_and_nothing_follows(llama_dir):
    # The releases used to ride with the next step that schedules a request: an idle engine
    # kept every finished request's [V] mask until one came.
    llm = LLM(model=str(llama_dir), dtype="float32", max_model_len=128, max_num_seqs=8)
    try:
        engine = llm.llm_engine
        masks = engine.executor.driver_worker.model_runner.allowed_token_masks
        prompts = random_prompts(6, seed=3, min_len=5, max_len=12)
        finishing = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, allowed_token_ids=ALLOWED)
        llm.generate([{"prompt_token_ids": p} for p in prompts[:3]], finishing, use_tqdm=False)
        assert masks.num_built == 3 and len(masks) == 0

        unending = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True, allowed_token_ids=ALLOWED)
        for i, prompt in enumerate(prompts[3:]):
            engine.add_request(f"aborted-{i}", {"prompt_token_ids": prompt}, unending)
        engine.step()
        engine.step()
        assert len(masks) == 3
        engine.abort_request([f"aborted-{i}" for i in range(3)])
        while engine.has_unfinished_requests():  # what any driving loop does
            engine.step()
        assert len(masks) == 0
        assert_engine_idle(engine)
    finally:
        llm.shutdown()

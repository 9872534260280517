"""Penalties and min_tokens read each request's token history, which the worker that
samples keeps in a growing buffer (executors/token_history.py) and hands the native pass
without a copy. Over whole generations the engine's greedy tokens equal a PyTorch
reference that penalises Hugging Face's logits over the whole vocabulary at every step
(tests/penalty_reference.py), while requests are preempted and recomputed, prefilled in
chunks and hit the prefix cache, and while speculative decoding appends several tokens a
step and takes back rejected ones (a draft model reads its own proposals too); and
repetition_penalty alone gives HF generate's own tokens (its RepetitionPenaltyLogitsProcessor).
Every test runs twice: penalties from the host's histories (the CPU's native pass), and from
the penalty state a GPU keeps on the device (executors/penalty_state.py, turned on here for
the CPU), whose rows are rebuilt on readmission and count accepted proposals."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from engine_checks import assert_engine_idle
from hf_reference import hf_model
from penalty_reference import penalised_greedy
from test_spec_decode import draft_dirs, _speculative_config  # noqa: F401 (a fixture)
from raylm.engine import LLM, SamplingParams
from raylm.executors.model_runner import ModelRunner

# 12 requests of up to ~70 tokens over 12 blocks of 16, prefilled in chunks of up to 24
# tokens: they preempt each other and resume from the prefix cache.
SMALL_POOL = dict(dtype="float32", max_model_len=128, num_gpu_blocks_override=12, max_num_batched_tokens=24)
# (repetition, frequency, presence), cycled over the requests.
PENALTIES = [(1.3, 0.0, 0.0), (1.2, 0.4, 0.3), (0.8, 0.0, -0.5), (1.0, 0.5, 0.0), (2.0, -0.3, 0.6)]


@pytest.fixture(autouse=True, params=["host-histories", "device-state"])
def penalty_path(request, monkeypatch):
    if request.param == "device-state":
        monkeypatch.setattr(ModelRunner, "penalty_state_devices", ("cuda", "cpu"))
    return request.param


def _prompts(count: int, seed: int) -> list[list[int]]:
    """Half random, half repeating a short pattern (repeats are what penalties act on, and
    what n-gram lookups propose)."""
    rng = random.Random(seed)
    prompts = []
    for i in range(count):
        if i % 2:
            pattern = [rng.randrange(4, 512) for _ in range(rng.randint(2, 5))]
            prompts.append((pattern * 12)[:rng.randint(20, 40)])
        else:
            prompts.append([rng.randrange(4, 512) for _ in range(rng.randint(5, 40))])
    return prompts


def _requests(model_dir: Path, count: int, seed: int, penalties: list[tuple[float, float, float]]
              ) -> tuple[list[list[int]], list[SamplingParams], list[list[int]]]:
    """Prompts, their greedy penalised parameters (every third with min_tokens against
    a stop token the request would otherwise emit early), and the reference's tokens."""
    prompts = _prompts(count, seed)
    params, expected = [], []
    for i, prompt in enumerate(prompts):
        repetition, frequency, presence = penalties[i % len(penalties)]
        penalty = dict(repetition_penalty=repetition, frequency_penalty=frequency, presence_penalty=presence)
        max_tokens = 24 + i % 5
        stop: dict = {}
        if i % 3 == 0:
            # A token of the unconstrained continuation, masked until min_tokens are out.
            early = penalised_greedy(model_dir, prompt, 4, repetition, frequency, presence)
            stop = dict(stop_token_ids=[early[1]], min_tokens=6)
        params.append(SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **penalty, **stop))
        expected.append(penalised_greedy(model_dir, prompt, max_tokens, repetition, frequency, presence,
                                         tuple(stop.get("stop_token_ids", ())), stop.get("min_tokens", 0)))
    return prompts, params, expected


def test_penalised_greedy_tokens_equal_the_dense_reference_while_preempting(llama_dir):
    prompts, params, expected = _requests(llama_dir, 12, seed=3, penalties=PENALTIES)
    with LLM(model=str(llama_dir), **SMALL_POOL) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        engine = llm.llm_engine
        assert engine.scheduler.num_preemptions > 0
        assert_engine_idle(engine)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    # The min_tokens requests did hold their stop token back, and some stopped at it later.
    assert any(len(e) < p.max_tokens for e, p in zip(expected, params) if p.min_tokens)


@pytest.mark.parametrize("method", ["ngram", "draft-good"])
def test_penalised_greedy_tokens_equal_the_dense_reference_with_speculative_decoding(method, llama_dir, draft_dirs):
    # Mild penalties: the requests still repeat themselves, so proposals are accepted.
    prompts, params, expected = _requests(llama_dir, 12, seed=4, penalties=[(1.05, 0.0, 0.0), (1.02, 0.05, 0.05)])
    with LLM(model=str(llama_dir), **SMALL_POOL, speculative_config=_speculative_config(method, draft_dirs)) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        engine = llm.llm_engine
        stats = engine.scheduler.drafter.stats
        assert engine.scheduler.num_preemptions > 0
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # accepted and rejected proposals
        assert_engine_idle(engine)
    assert [o.outputs[0].token_ids for o in outputs] == expected


def test_a_draft_that_is_the_target_proposes_its_penalised_tokens_so_all_are_accepted(llama_dir):
    # The draft reads the history followed by its own proposals so far, as the target's
    # rows after them do; reading the history alone, it proposed ~11% tokens the target's
    # penalties refuse.
    prompts, params, expected = _requests(llama_dir, 12, seed=6, penalties=PENALTIES)
    with LLM(model=str(llama_dir), **SMALL_POOL,
             speculative_config={"model": str(llama_dir), "num_speculative_tokens": 3}) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        stats = llm.llm_engine.scheduler.drafter.stats
        assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == stats.num_draft_tokens
    assert [o.outputs[0].token_ids for o in outputs] == expected


def test_repetition_penalty_gives_hf_generates_greedy_tokens_while_preempting(llama_dir):
    prompts = _prompts(12, seed=5)
    max_tokens = 24
    model = hf_model(str(llama_dir))
    expected = []
    with torch.no_grad():
        for prompt in prompts:
            out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 max_new_tokens=max_tokens, do_sample=False, repetition_penalty=1.3, pad_token_id=0)
            expected.append(out[0, len(prompt):].tolist())
    with LLM(model=str(llama_dir), **SMALL_POOL) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                              repetition_penalty=1.3), use_tqdm=False)
        assert llm.llm_engine.scheduler.num_preemptions > 0
    for want, output in zip(expected, outputs):
        assert output.outputs[0].token_ids[:len(want)] == want  # HF stops at EOS, raylm ignores it

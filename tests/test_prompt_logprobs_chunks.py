"""Prompt logprobs are computed a bounded chunk of rows at a time
(`executors/prompt_logprobs.py`): the memory a step adds for them stays a few [chunk, V]
tensors however long the prompt chunk is (a 32k-token chunk at a 152k vocabulary used to
take ~19 GB of fp32 logits and log-softmax at once), and the values are unchanged: equal
to Hugging Face's log-softmax, and to the same rows scored in one chunk."""

from __future__ import annotations

import pytest
import torch

from hf_reference import assert_logprobs_match_hf
from raylm.engine import LLM, SamplingParams
from raylm.engine.config import (CacheConfig, DeviceConfig, EngineConfig, ModelConfig, ParallelConfig,
                                 SchedulerConfig, load_hf_config)
from raylm.engine.step import ExecuteModelRequest, ScheduledRequest
from raylm.executors import prompt_logprobs
from raylm.executors.model_runner import ModelRunner
from tensor_memory import PeakTensorBytes
from tiny_models import build_tiny_model, random_prompts

BLOCK_SIZE = 16
MAX_LEN = 1024
# A vocabulary large beside the hidden size (64), so that [rows, V] tensors dominate a step.
VOCAB = 8192
CHUNK_ROWS = 16


@pytest.fixture(scope="module")
def wide_vocab_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("wide_vocab"), "llama", vocab_size=VOCAB,
                            max_position_embeddings=MAX_LEN)


@pytest.fixture(scope="module")
def runner(wide_vocab_dir):
    config = EngineConfig(
        model_config=ModelConfig(model=str(wide_vocab_dir), tokenizer=str(wide_vocab_dir), dtype=torch.float32,
                                 max_model_len=MAX_LEN, hf_config=load_hf_config(str(wide_vocab_dir))),
        cache_config=CacheConfig(block_size=BLOCK_SIZE, num_gpu_blocks_override=MAX_LEN // BLOCK_SIZE),
        scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=MAX_LEN, max_model_len=MAX_LEN),
        parallel_config=ParallelConfig(), device_config=DeviceConfig("cpu"))
    runner = ModelRunner(config, rank=0, device="cpu")
    runner.load_model()
    runner.initialize_cache(runner.determine_num_available_blocks())
    return runner


def _prefill(prompt: list[int], params: SamplingParams, req_id: int = 0) -> ExecuteModelRequest:
    scored = params.prompt_logprobs is not None
    return ExecuteModelRequest([ScheduledRequest(
        req_id=req_id, token_ids=list(prompt), num_computed_tokens=0,
        block_table=list(range(-(-len(prompt) // BLOCK_SIZE))), num_prompt_tokens=len(prompt),
        sampling_params=params, prompt_logprobs_targets=prompt[1:] if scored else None)],
        finished_req_ids=[req_id - 1] if req_id else [])


def _step_peak(runner: ModelRunner, request: ExecuteModelRequest) -> int:
    with PeakTensorBytes() as memory:
        runner.execute_model(request)
    return memory.peak


@pytest.mark.parametrize("prompt_len", [256, 1000])
def test_prompt_logprobs_add_at_most_a_few_chunks_of_rows_to_a_steps_peak(runner, monkeypatch, prompt_len):
    # The same prefill step with and without prompt logprobs: what they add to the peak of
    # tensor memory is bounded by the chunk (4 x [16, V] fp32 = 2 MiB), not by the prompt
    # (one [prompt_len, V] fp32 tensor is 8 MiB at 256 rows, 31 MiB at 1000).
    monkeypatch.setattr(runner, "prompt_logprobs_chunk_rows", CHUNK_ROWS)
    prompt = random_prompts(1, seed=prompt_len, min_len=prompt_len, max_len=prompt_len, vocab_size=VOCAB)[0]
    plain = _step_peak(runner, _prefill(prompt, SamplingParams(temperature=0.0), req_id=1))
    scored = _step_peak(runner, _prefill(prompt, SamplingParams(temperature=0.0, prompt_logprobs=5), req_id=2))
    row_bytes = VOCAB * 4
    assert scored - plain <= 4 * CHUNK_ROWS * row_bytes, (
        f"prompt logprobs added {(scored - plain) / row_bytes:.0f} rows of V fp32 to the step's peak")


@torch.no_grad()
def test_prompt_logprobs_in_chunks_equal_one_chunk_and_hf(runner, wide_vocab_dir, monkeypatch):
    from transformers import AutoModelForCausalLM

    prompt = random_prompts(1, seed=3, min_len=50, max_len=50, vocab_size=VOCAB)[0]
    params = SamplingParams(temperature=0.0, prompt_logprobs=3)
    monkeypatch.setattr(runner, "prompt_logprobs_chunk_rows", 1024)
    whole = runner.execute_model(_prefill(prompt, params, req_id=3)).prompt_logprobs[3]
    monkeypatch.setattr(runner, "prompt_logprobs_chunk_rows", 7)  # 49 rows: 7 chunks
    chunked = runner.execute_model(_prefill(prompt, params, req_id=4)).prompt_logprobs[4]
    assert chunked == whole
    hf = AutoModelForCausalLM.from_pretrained(str(wide_vocab_dir), dtype=torch.float32).eval()
    reference = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)
    assert [entry.token_id for entry in chunked] == prompt[1:]
    for position, entry in enumerate(chunked):
        expected = reference[position, prompt[position + 1]].item()
        assert entry.logprob == pytest.approx(expected, abs=1e-4)
        assert entry.rank == int((reference[position] > expected + 1e-6).sum()) + 1
        assert [token for token, _ in entry.top] == reference[position].topk(3).indices.tolist()


def test_llm_prompt_logprobs_in_small_chunks_match_hf(llama_dir, monkeypatch):
    # The whole engine, with prefill chunks of 16 tokens scored 5 rows at a time, beside
    # requests that only decode.
    monkeypatch.setattr(prompt_logprobs, "PROMPT_LOGPROBS_CHUNK_ROWS", 5)
    llm = LLM(model=str(llama_dir), dtype="float32", max_num_seqs=8, max_num_batched_tokens=16)
    try:
        assert llm.llm_engine.executor.driver_worker.model_runner.prompt_logprobs_chunk_rows == 5
        prompts = random_prompts(4, seed=6, min_len=20, max_len=45)
        params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=2, prompt_logprobs=2, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert_logprobs_match_hf(llama_dir, prompts, outputs, top_k=2)
    finally:
        llm.shutdown()


def test_tp2_prompt_logprobs_over_several_chunks_match_hf(ray_cluster, tmp_path):
    # 299 scored rows: two chunks of the default 256, each gathered from both ranks to rank 0.
    model_dir = build_tiny_model(tmp_path / "long", "llama", max_position_embeddings=512)
    prompt = random_prompts(1, seed=8, min_len=300, max_len=300)[0]
    assert len(prompt) - 1 > prompt_logprobs.PROMPT_LOGPROBS_CHUNK_ROWS
    llm = LLM(model=str(model_dir), dtype="float32", max_model_len=512, max_num_seqs=4, tensor_parallel_size=2,
              distributed_executor_backend="ray")
    try:
        params = SamplingParams(temperature=0.0, max_tokens=2, logprobs=1, prompt_logprobs=2, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        assert_logprobs_match_hf(model_dir, [prompt], outputs, top_k=1)
    finally:
        llm.shutdown()

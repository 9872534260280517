"""The in-process executor's step thread (on by default on GPUs only): steps run in a
thread of their own, so the engine schedules the next step and processes the last one's
outputs meanwhile, with async scheduling as on Ray. Checked here on the CPU, where the
thread is real and only the default differs: the tokens equal HF's through chunked
prefill, preemption and a stop token, and shutdown waits for the step in flight."""

from __future__ import annotations

import pytest

from hf_reference import hf_greedy
from raylm.engine import LLM, SamplingParams
from raylm.executors.uniproc_executor import UniProcExecutor

# Lengths as in the device check's stage b, where 24 blocks of 16 force a preemption.
PROMPTS = [[(37 * i + 11 * n) % 500 + 3 for i in range(n)] for n in (5, 33, 100, 7, 60, 45, 70, 20)]


@pytest.fixture
def step_thread_on_cpu(monkeypatch):
    monkeypatch.setattr(UniProcExecutor, "step_thread_devices", ("cuda", "cpu"))


def test_steps_in_the_step_thread_give_hf_greedy_tokens(llama_dir, step_thread_on_cpu):
    llm = LLM(model=str(llama_dir), dtype="float32", max_num_seqs=8, max_model_len=160, max_num_batched_tokens=64,
              num_gpu_blocks_override=24, block_size=16)
    try:
        core = llm.llm_engine.engine_core
        assert core.runs_steps_asynchronously and core.async_scheduling
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                               SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
        expected = [hf_greedy(llama_dir, p, 12) for p in PROMPTS]
        assert [o.outputs[0].token_ids for o in outputs] == expected
        assert llm.llm_engine.scheduler.num_preemptions > 0  # 24 blocks are too few for the batch
        stop = expected[0][3]
        (stopped,) = llm.generate([{"prompt_token_ids": PROMPTS[0]}],
                                  SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop]),
                                  use_tqdm=False)
        assert stopped.outputs[0].token_ids == expected[0][:4] and stopped.outputs[0].finish_reason == "stop"
    finally:
        llm.shutdown()


def test_cpu_steps_run_in_the_callers_thread_by_default(llama_dir):
    llm = LLM(model=str(llama_dir), dtype="float32", max_num_seqs=2, max_model_len=64)
    try:
        assert not llm.llm_engine.engine_core.runs_steps_asynchronously
    finally:
        llm.shutdown()

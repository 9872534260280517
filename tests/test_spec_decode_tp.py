"""Speculative decoding with tensor parallelism over Ray workers, async scheduling on (the
default there): greedy tokens equal HF's for both methods while requests preempt each other,
a request that proposes waits for its verification while the others keep the pipeline full,
and no block leaks."""

from __future__ import annotations

import pytest

from engine_checks import assert_engine_idle
from hf_reference import hf_greedy
from test_spec_decode import _prompts, draft_dirs  # noqa: F401 - the module fixture
from test_spec_decode_eagle import head_dir  # noqa: F401 - the module fixture
from raylm.engine import LLM, SamplingParams
from raylm.engine.step import PLACEHOLDER_TOKEN_ID

COMMON = dict(dtype="float32", tensor_parallel_size=2, distributed_executor_backend="ray", max_model_len=128,
              num_gpu_blocks_override=12)
CONFIGS = {
    "ngram": lambda drafts: {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
                             "prompt_lookup_min": 1},
    "draft": lambda drafts: {"model": str(drafts["good"]), "num_speculative_tokens": 3},
    "eagle": lambda drafts: {"method": "eagle", "model": str(drafts["eagle"]), "num_speculative_tokens": 3},
}


@pytest.mark.parametrize("method", list(CONFIGS))
def test_greedy_tokens_equal_hf_at_tp2_with_async_scheduling(method, ray_cluster, llama_dir, draft_dirs, head_dir):
    llm = LLM(model=str(llama_dir), **COMMON, speculative_config=CONFIGS[method]({**draft_dirs, "eagle": head_dir}))
    core = llm.llm_engine.engine_core
    assert core.async_scheduling
    seen = {"pipelined": 0, "verifications": 0}
    send = core.executor.execute_model_async

    def watched(req):
        seen["pipelined"] += any(s.token_ids[-1] == PLACEHOLDER_TOKEN_ID for s in req.requests)
        seen["verifications"] += sum(bool(s.spec_token_ids) for s in req.requests)
        return send(req)

    core.executor.execute_model_async = watched
    try:
        prompts = _prompts(10, seed=5)
        max_tokens = [28 - i for i in range(len(prompts))]
        params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for prompt, m, output in zip(prompts, max_tokens, outputs):
            expected = hf_greedy(llama_dir, prompt, m)
            assert output.outputs[0].token_ids[:len(expected)] == expected
        stats = llm.llm_engine.scheduler.drafter.stats
        assert stats.num_accepted_tokens > 0 and llm.llm_engine.scheduler.num_preemptions > 0
        # Requests proposing were verified; the others (no proposal this step) were pipelined.
        assert seen["verifications"] > 0 and seen["pipelined"] > 0
        assert_engine_idle(llm.llm_engine)
    finally:
        del core.executor.execute_model_async
        llm.shutdown()

"""Deferred reads in the in-process step thread (the GPU path, checked here on the CPU,
where the thread is real): a step that only draws tokens is launched, the next step is
launched on the device's copy of its tokens, and only then are the first step's tokens
read. Outputs must equal those of steps run one at a time in the caller's thread, for
every sampling feature: the features that need the host's tokens (penalties) wait for
them; the others take them on the device."""

from __future__ import annotations

import pytest

from raylm.engine import LLM, SamplingParams
from raylm.executors import model_runner as model_runner_module
from raylm.executors.uniproc_executor import UniProcExecutor

PROMPTS = [[(37 * i + 11 * n) % 500 + 3 for i in range(n)] for n in (5, 33, 100, 7, 60, 45, 70, 20)]

PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=10, ignore_eos=True, logprobs=2),
    SamplingParams(temperature=0.0, max_tokens=9, repetition_penalty=1.3, frequency_penalty=0.4, ignore_eos=True),
    SamplingParams(temperature=1.0, top_k=20, seed=3, n=2, max_tokens=8, ignore_eos=True),
    SamplingParams(temperature=0.0, max_tokens=11, min_tokens=4, logit_bias={5: 3.0}, logprobs=1),
    SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[300, 301, 302]),
    SamplingParams(temperature=0.7, seed=11, presence_penalty=0.5, max_tokens=10, ignore_eos=True),
    SamplingParams(temperature=0.0, max_tokens=6, prompt_logprobs=1, ignore_eos=True),
]


# The same features without token histories: every decode step may take its tokens on the device.
NO_HISTORY = [params for params in PARAMS if not (params.repetition_penalty != 1.0 or params.frequency_penalty
                                                   or params.presence_penalty)]


def _generate(llama_dir, params: list[SamplingParams]) -> list:
    llm = LLM(model=str(llama_dir), dtype="float32", max_num_seqs=8, max_model_len=160, max_num_batched_tokens=64,
              num_gpu_blocks_override=24, block_size=16)
    try:
        prompts = [{"prompt_token_ids": p} for p in PROMPTS]
        outputs = llm.generate(prompts, [params[i % len(params)] for i in range(len(PROMPTS))], use_tqdm=False)
        blocks = llm.llm_engine.scheduler.kv_cache_manager.block_pool
        free_after = blocks.get_num_free_blocks()
        return [[(c.token_ids, c.cumulative_logprob, c.logprobs, c.finish_reason) for c in o.outputs] +
                [o.prompt_logprobs] for o in outputs], free_after, llm.llm_engine.scheduler.num_preemptions
    finally:
        llm.shutdown()


@pytest.fixture
def holes_filled_on_device(monkeypatch):
    """Counts the input rows whose token a step took on the device (a spy on the real
    function, which still runs)."""
    count = [0]
    fill = model_runner_module._fill_holes

    def counting(input_ids, holes):
        count[0] += len(holes)
        fill(input_ids, holes)

    monkeypatch.setattr(model_runner_module, "_fill_holes", counting)
    return count


@pytest.mark.parametrize("params", [PARAMS, NO_HISTORY], ids=["with-penalties", "without-histories"])
def test_deferred_reads_give_the_outputs_of_steps_run_one_at_a_time(llama_dir, monkeypatch, holes_filled_on_device,
                                                                    params):
    expected, free_expected, _ = _generate(llama_dir, params)
    assert holes_filled_on_device[0] == 0
    monkeypatch.setattr(UniProcExecutor, "step_thread_devices", ("cuda", "cpu"))
    got, free_after, preemptions = _generate(llama_dir, params)
    assert holes_filled_on_device[0] > (30 if params is NO_HISTORY else 0)
    assert preemptions > 0  # 24 blocks are too few for the batch: recomputed requests too
    assert got == expected
    assert free_after == free_expected


def test_a_penalised_request_waits_for_its_tokens_and_others_do_not(llama_dir, monkeypatch, holes_filled_on_device):
    monkeypatch.setattr(UniProcExecutor, "step_thread_devices", ("cuda", "cpu"))
    llm = LLM(model=str(llama_dir), dtype="float32", max_num_seqs=4, max_model_len=160)
    try:
        penalised = SamplingParams(temperature=0.0, max_tokens=8, repetition_penalty=1.5, ignore_eos=True)
        (alone,) = llm.generate([{"prompt_token_ids": PROMPTS[1]}], penalised, use_tqdm=False)
        assert holes_filled_on_device[0] == 0  # every step waited for the host's tokens
        plain = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": PROMPTS[0]}, {"prompt_token_ids": PROMPTS[1]}],
                               [plain, penalised], use_tqdm=False)
        assert outputs[1].outputs[0].token_ids == alone.outputs[0].token_ids
    finally:
        llm.shutdown()


def test_aborting_mid_run_frees_everything_and_leaves_the_others_unchanged(llama_dir, monkeypatch,
                                                                           holes_filled_on_device):
    # Aborted while its deferred step is still unread: its pending token must not come back
    # as a later step's input for anyone, and its blocks go back to the pool.
    monkeypatch.setattr(UniProcExecutor, "step_thread_devices", ("cuda", "cpu"))
    llm = LLM(model=str(llama_dir), dtype="float32", max_num_seqs=8, max_model_len=160, block_size=16)
    try:
        engine = llm.llm_engine
        params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        expected = {o.request_id: o.outputs[0].token_ids
                    for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:4]], params, use_tqdm=False)}
        pool = engine.scheduler.kv_cache_manager.block_pool
        free_before = pool.get_num_free_blocks()
        for i, prompt in enumerate(PROMPTS[:4]):
            engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params)
        finished = {}
        for step in range(200):
            if step == 6:
                engine.abort_request(["r1", "r3"])
            for output in engine.step():
                if output.finished:
                    finished[output.request_id] = output.outputs[0].token_ids
            if not engine.has_unfinished_requests():
                break
        assert holes_filled_on_device[0] > 0
        assert set(finished) >= {"r0", "r2"}
        assert [finished["r0"], finished["r2"]] == [expected["0"], expected["2"]]
        assert pool.get_num_free_blocks() == free_before
        assert not engine.executor.driver_worker.model_runner._pending_samples
    finally:
        llm.shutdown()

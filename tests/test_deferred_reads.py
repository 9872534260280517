"""Deferred reads in the in-process step thread (the GPU path, checked here on the CPU,
where the thread is real): a step that only draws tokens is launched, the next step is
launched on the device's copy of its tokens, and only then are the first step's tokens
read. Outputs must equal those of steps run one at a time in the caller's thread, for
every sampling feature: the features that need the host's tokens (penalties read from the
host's histories, as the CPU's native pass does) wait for them; the others take them on the
device, and so do penalties read from the device's penalty state (a GPU's path:
executors/penalty_state.py, turned on here for the CPU), which counts each step's drawn
tokens on the device."""

from __future__ import annotations

import pytest

from penalty_reference import penalised_greedy
from raylm.engine import LLM, SamplingParams
from raylm.executors import sampler as sampler_module
from raylm.executors.model_runner import ModelRunner
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


# Penalised requests of every kind beside unpenalised ones (greedy and seeded, n=2), for the
# penalty state on the device: their steps need no token on the host.
PENALISED = [
    SamplingParams(temperature=0.0, max_tokens=12, repetition_penalty=1.3, ignore_eos=True, logprobs=1),
    SamplingParams(temperature=0.0, max_tokens=10, frequency_penalty=0.6, ignore_eos=True),
    SamplingParams(temperature=0.0, max_tokens=11, ignore_eos=True),
    SamplingParams(temperature=0.0, max_tokens=9, presence_penalty=0.8, repetition_penalty=0.9, ignore_eos=True),
    SamplingParams(temperature=0.9, seed=5, n=2, max_tokens=10, repetition_penalty=1.2, frequency_penalty=0.3,
                   ignore_eos=True, logprobs=0),
    SamplingParams(temperature=0.0, max_tokens=12, repetition_penalty=1.1, frequency_penalty=-0.2,
                   presence_penalty=0.4, ignore_eos=True),
    SamplingParams(temperature=0.8, seed=2, max_tokens=10, ignore_eos=True),
    SamplingParams(temperature=0.0, max_tokens=8, frequency_penalty=1.5, logit_bias={7: 2.0}, ignore_eos=True),
]


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
        _assert_penalty_rows_come_back(llm)
        llm.shutdown()


def _assert_same_outputs(got: list, expected: list) -> None:
    """The same tokens, finish reasons, logprob keys and ranks; logprob values equal up to
    float rounding. Deferred steps batch rows differently (the tiny Llama's run here took one
    step more, and one step of 3 rows where steps one at a time had 5), and on the CPU the
    fp32 kernel a batch size takes is timed at load (cpu_gemm): on an AVX2 EPYC one row ran
    on MKL and two on the AVX2 kernel, which round the same row a few ulps apart."""
    assert len(got) == len(expected)
    for got_request, expected_request in zip(got, expected):
        *got_completions, got_prompt_logprobs = got_request
        *expected_completions, expected_prompt_logprobs = expected_request
        assert len(got_completions) == len(expected_completions)
        for (tokens, cumulative, logprobs, reason), (want_tokens, want_cumulative, want_logprobs, want_reason) in zip(
                got_completions, expected_completions):
            assert (tokens, reason) == (want_tokens, want_reason)
            assert (cumulative is None) == (want_cumulative is None)
            if want_cumulative is not None:
                assert cumulative == pytest.approx(want_cumulative, rel=1e-6, abs=1e-5)
            _assert_close_logprobs(logprobs, want_logprobs)
        _assert_close_logprobs(got_prompt_logprobs, expected_prompt_logprobs)


def _assert_close_logprobs(got, expected) -> None:
    if expected is None:
        assert got is None
        return
    assert len(got) == len(expected)
    for got_position, expected_position in zip(got, expected):
        if expected_position is None:
            assert got_position is None
            continue
        assert {t: (lp.rank, lp.decoded_token) for t, lp in got_position.items()} == \
            {t: (lp.rank, lp.decoded_token) for t, lp in expected_position.items()}
        for token, logprob in expected_position.items():
            assert got_position[token].logprob == pytest.approx(logprob.logprob, rel=1e-6, abs=1e-5)


def _assert_penalty_rows_come_back(llm: LLM) -> None:
    """Every penalty row is free once the workers hear of the last requests' end (the ids
    ride along with the next step: one plain request is run for it)."""
    state = llm.llm_engine.executor.driver_worker.model_runner.penalty_state
    if state is None:
        return
    llm.generate([{"prompt_token_ids": [5, 6]}], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    assert state.num_free_rows == state.output_counts.shape[0]
    assert not state._rows


@pytest.fixture
def penalty_state_on_cpu(monkeypatch):
    """Penalties read the penalty state kept on the device (a GPU's path), on the CPU."""
    monkeypatch.setattr(ModelRunner, "penalty_state_devices", ("cuda", "cpu"))


@pytest.fixture
def forced_collects(monkeypatch):
    """Counts the steps that had to wait for the host's copy of a deferred step's tokens
    (a spy on the real method, whose answer stands)."""
    count = [0]
    needs = ModelRunner.needs_collected_tokens

    def counting(self, req):
        answer = needs(self, req)
        count[0] += answer
        return answer

    monkeypatch.setattr(ModelRunner, "needs_collected_tokens", counting)
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
    _assert_same_outputs(got, expected)
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


def test_penalised_requests_under_deferred_reads_give_the_host_historys_outputs_without_waiting(
        llama_dir, monkeypatch, holes_filled_on_device, forced_collects):
    # Reference: steps run one at a time, penalties from the host histories (the native pass).
    expected, free_expected, _ = _generate(llama_dir, PENALISED)
    monkeypatch.setattr(UniProcExecutor, "step_thread_devices", ("cuda", "cpu"))
    monkeypatch.setattr(ModelRunner, "penalty_state_devices", ("cuda", "cpu"))
    # No step sends its rows' token histories over (the padded copy of the host's tokens).
    monkeypatch.setattr(sampler_module, "_padded_token_ids", None)
    got, free_after, preemptions = _generate(llama_dir, PENALISED)
    assert preemptions > 0  # recomputed requests rebuild their rows
    assert forced_collects[0] == 0
    assert holes_filled_on_device[0] > 30  # penalised decodes too took their tokens on the device
    _assert_same_outputs(got, expected)
    assert free_after == free_expected


def test_penalised_greedy_tokens_from_the_device_state_equal_the_dense_reference(llama_dir, monkeypatch,
                                                                                 penalty_state_on_cpu):
    # vLLM's formula over the whole vocabulary on Hugging Face's logits (tests/penalty_reference.py).
    monkeypatch.setattr(UniProcExecutor, "step_thread_devices", ("cuda", "cpu"))
    greedy = [p for p in PENALISED if p.temperature == 0.0 and not p.logit_bias]
    params = [greedy[i % len(greedy)] for i in range(len(PROMPTS))]
    expected = [penalised_greedy(llama_dir, prompt, p.max_tokens, p.repetition_penalty, p.frequency_penalty,
                                 p.presence_penalty) for prompt, p in zip(PROMPTS, params)]
    with LLM(model=str(llama_dir), dtype="float32", max_num_seqs=8, max_model_len=160, max_num_batched_tokens=64,
             num_gpu_blocks_override=24, block_size=16) as llm:
        outputs = llm.generate([{"prompt_token_ids": prompt} for prompt in PROMPTS], params, use_tqdm=False)
        assert llm.llm_engine.scheduler.num_preemptions > 0
        _assert_penalty_rows_come_back(llm)
    assert [o.outputs[0].token_ids for o in outputs] == expected


def test_aborting_penalised_requests_mid_run_frees_their_rows_and_leaves_the_others_unchanged(
        llama_dir, monkeypatch, holes_filled_on_device, penalty_state_on_cpu, forced_collects):
    monkeypatch.setattr(UniProcExecutor, "step_thread_devices", ("cuda", "cpu"))
    llm = LLM(model=str(llama_dir), dtype="float32", max_num_seqs=8, max_model_len=160, block_size=16)
    try:
        engine = llm.llm_engine
        params = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, repetition_penalty=1.4),
                  SamplingParams(temperature=0.8, seed=4, max_tokens=16, ignore_eos=True, frequency_penalty=0.7, n=2),
                  SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, presence_penalty=0.9),
                  SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)]
        expected = {o.request_id: [c.token_ids for c in o.outputs]
                    for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:4]], params, use_tqdm=False)}
        state = engine.executor.driver_worker.model_runner.penalty_state
        pool = engine.scheduler.kv_cache_manager.block_pool
        free_before = pool.get_num_free_blocks()
        for i, prompt in enumerate(PROMPTS[:4]):
            engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params[i])
        finished = {}
        for step in range(200):
            if step == 6:
                assert state.num_free_rows < 8 - 2  # the penalised requests and siblings hold rows
                engine.abort_request(["r1", "r3"])
            for output in engine.step():
                if output.finished:
                    finished[output.request_id] = [c.token_ids for c in output.outputs]
            if not engine.has_unfinished_requests():
                break
        assert holes_filled_on_device[0] > 0 and forced_collects[0] == 0
        assert [finished["r0"], finished["r2"]] == [expected["0"], expected["2"]]
        assert pool.get_num_free_blocks() == free_before
        _assert_penalty_rows_come_back(llm)
    finally:
        llm.shutdown()

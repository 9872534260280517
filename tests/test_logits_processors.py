"""Custom logits processors (vLLM v1's `logits_processors`, engine/logits_processor.py),
checked by arithmetic and against Hugging Face's greedy tokens: a request that asks the
docs' DummyLogitsProcessor for a target token (SamplingParams.extra_args) draws only that
token; the others in its batch draw HF's greedy tokens; this holds while requests join,
finish at different steps (rows move), are preempted and resumed, under async scheduling,
over Ray at tensor-parallel size 2 (the class pickled to the workers), and over HTTP with
the server's `--logits-processors` and `vllm_xargs`. A processor that raises ends the
step's requests with its error; the engine serves on with every KV block back."""

from __future__ import annotations

import os
import random
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch

from engine_checks import assert_engine_idle, tensor_parallel_llm
from hf_reference import cached_hf_greedy
from logits_processor_examples import ArgmaxInvariantDummy, DummyLogitsProcessor
from raylm.engine import LLM, EngineArgs, SamplingParams
from raylm.engine.logits_processor import process_dict_updates
from raylm.engine.step import ScheduledRequest
from raylm.executors.logits_processors import LogitsProcessors
from raylm.executors.uniproc_executor import UniProcExecutor
from server_process import running_server, server_env
from tiny_models import random_prompts

ENGINE = dict(dtype="float32", max_model_len=128, max_num_seqs=3)
PROCESSORS = [DummyLogitsProcessor, "logits_processor_examples:CountUpAdapter", ArgmaxInvariantDummy,
              "logits_processor_examples.RaisingLogitsProcessor"]
TARGETS = {0: 7, 3: 100, 4: 7}  # request index -> its target_token


@pytest.fixture(scope="module")
def llm(llama_dir):
    """Async scheduling with deferred reads (the GPU's path, walked on the CPU) and a KV cache
    of one max_model_len (8 blocks), which three running requests outgrow: preemptions."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(UniProcExecutor, "step_thread_devices", ("cuda", "cpu"))
        llm = LLM(model=str(llama_dir), num_gpu_blocks_override=8, logits_processors=PROCESSORS, **ENGINE)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(7, seed=3, min_len=24, max_len=40)


def _params(index: int, max_tokens: int, temperature: float = 0.0, **extra_args) -> SamplingParams:
    target = TARGETS.get(index)
    if target is not None:
        extra_args["target_token"] = target
    return SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True, seed=index,
                          extra_args=extra_args or None)


def _generate(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(output.outputs[0].token_ids) for output in outputs]


def test_batch_updates_put_every_request_on_its_logits_row():
    """The bookkeeping alone, over random batches (joins, finishes, reorders): after each
    update a processor applying it as vLLM's interface says (process_dict_updates), and the
    docs' DummyLogitsProcessor (added before removed), both hold each request at the row the
    step's logits give it; no index reaches max_num_seqs, and none is both removed and added."""
    max_rows = 6
    batch = LogitsProcessors([], SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=max_rows)),
                             torch.device("cpu"), False)
    dummy = DummyLogitsProcessor(None, torch.device("cpu"), False)
    by_index: dict[int, int] = {}
    rng = random.Random(0)
    running: list[int] = []
    next_id = previous_size = 0
    for _ in range(400):
        running = [req_id for req_id in running if rng.random() > 0.3]
        while len(running) < max_rows and rng.random() < 0.7:
            running.append(next_id)
            next_id += 1
        rng.shuffle(running)
        requests = [ScheduledRequest(req_id, [1, 2], 0, [], 2, SamplingParams(
            extra_args={"target_token": req_id} if req_id % 2 else None), resumed=True) for req_id in running]
        req_id_of = {id(scheduled.sampling_params): scheduled.req_id for scheduled in requests}
        batch.track(requests)
        update = batch._batch_update(requests)
        if update is not None:
            assert update.batch_size == len(running)
            indices = (list(update.removed) + [added[0] for added in update.added]
                       + [index for move in update.moved for index in move[:2]])
            assert all(0 <= index < max_rows for index in indices)
            assert not set(update.removed) & {added[0] for added in update.added}
            if previous_size + len(update.added) <= max_rows:  # rows no request held were enough
                assert all(added[0] >= previous_size for added in update.added)
        previous_size = len(running)
        process_dict_updates(by_index, update, lambda params, prompt, output: req_id_of[id(params)])
        dummy.update_state(update)
        assert by_index == dict(enumerate(running))
        assert dummy.req_info == {row: req_id for row, req_id in enumerate(running) if req_id % 2}


def test_target_token_requests_draw_only_their_target_and_the_others_hf_greedy(llm, llama_dir, prompts):
    """Seven requests, three running at a time, each with its own length: rows are added,
    removed and moved as they join and finish, and some are preempted (the cache holds one
    max_model_len). One counts up through the adapter (it reads the running output list)."""
    scheduler = llm.llm_engine.scheduler
    preemptions = scheduler.num_preemptions
    lengths = [30, 12, 25, 40, 18, 33, 21]
    params = [_params(i, n, count_up=True) if i == 5 else _params(i, n) for i, n in enumerate(lengths)]
    outputs = _generate(llm, prompts, params)
    for i, (prompt, tokens) in enumerate(zip(prompts, outputs)):
        if i in TARGETS:
            assert tokens == [TARGETS[i]] * lengths[i]
        elif i == 5:
            assert tokens == [(prompts[5][-1] + k) % 512 for k in range(1, lengths[5] + 1)]
        else:
            assert tokens == cached_hf_greedy(llama_dir, tuple(prompt), lengths[i])
    assert scheduler.num_preemptions > preemptions
    assert ArgmaxInvariantDummy.applied == 0  # every batch was greedy
    assert_engine_idle(llm.llm_engine)


def test_argmax_invariant_processors_run_after_greedy_rows_took_their_argmax(llm, llama_dir, prompts):
    """ArgmaxInvariantDummy (declared invariant, though it is not) runs in batches with a
    random row: a random request asking it draws only its late_target; a greedy request
    asking it keeps HF's greedy tokens, drawn before it runs, as in vLLM."""
    params = [_params(1, 10, temperature=0.8, late_target=9), _params(2, 10, late_target=9), _params(6, 10)]
    outputs = _generate(llm, prompts[:3], params)
    assert outputs[0] == [9] * 10
    assert outputs[1] == cached_hf_greedy(llama_dir, tuple(prompts[1]), 10)
    assert ArgmaxInvariantDummy.applied > 0


def test_a_processor_that_raises_ends_the_step_requests_and_the_engine_serves_on(llm, llama_dir, prompts):
    with pytest.raises(RuntimeError, match=r"logits processor logits_processor_examples.RaisingLogitsProcessor "
                                           r"raised in apply: KeyError: 'boom'"):
        _generate(llm, prompts[:2], [_params(1, 6, explode=True), _params(2, 6)])
    # LLM.generate raises at the first failure; the next call finishes what is in flight.
    assert _generate(llm, prompts[1:2], [_params(1, 6)]) == [cached_hf_greedy(llama_dir, tuple(prompts[1]), 6)]
    assert_engine_idle(llm.llm_engine)


def test_validate_params_refuses_a_bad_extra_arg_before_the_request_runs(llm, prompts):
    with pytest.raises(ValueError, match="extra_args: the logits processor .*DummyLogitsProcessor refused .*"
                                         "target_token must be a non-negative integer, got 'x'"):
        _generate(llm, prompts[:1], [SamplingParams(max_tokens=2, extra_args={"target_token": "x"})])
    assert_engine_idle(llm.llm_engine)


def test_tensor_parallel_workers_get_the_class_pickled(request, llama_dir, prompts):
    """A class from a module the Ray workers cannot import (tests/ is not on their path)
    travels by value; the sampling worker (rank 0) runs it."""
    with tensor_parallel_llm(request, llama_dir, 2, logits_processors=[DummyLogitsProcessor], **ENGINE) as tp_llm:
        lengths = [9, 4, 7, 6, 5]
        outputs = _generate(tp_llm, prompts[:5], [_params(i, n) for i, n in enumerate(lengths)])
    for i, (prompt, tokens) in enumerate(zip(prompts, outputs)):
        expected = [TARGETS[i]] * lengths[i] if i in TARGETS else cached_hf_greedy(llama_dir, tuple(prompt), lengths[i])
        assert tokens == expected


def test_server_flag_loads_a_processor_by_name_and_vllm_xargs_reach_it(llama_dir, prompts, tmp_path):
    tests_dir = str(Path(__file__).parent)
    env = server_env({"PYTHONPATH": os.pathsep.join([tests_dir, os.environ.get("PYTHONPATH", "")])})
    args = [str(llama_dir), "--served-model-name", "tiny", "--dtype", "float32", "--max-model-len", "128",
            "--logits-processors", "logits_processor_examples:DummyLogitsProcessor",
            "logits_processor_examples.RaisingLogitsProcessor"]
    with running_server(args, tmp_path / "server.log", env) as (_, base_url):
        body = {"model": "tiny", "prompt": prompts[0], "max_tokens": 5, "temperature": 0, "return_token_ids": True}
        forced = httpx.post(f"{base_url}/v1/completions", json=body | {"vllm_xargs": {"target_token": 67}}, timeout=60)
        plain = httpx.post(f"{base_url}/v1/completions", json=body, timeout=60)
        chat = httpx.post(f"{base_url}/v1/chat/completions", timeout=60, json={
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0,
            "return_token_ids": True, "vllm_xargs": {"target_token": 68}})
        refused = httpx.post(f"{base_url}/v1/completions", json=body | {"vllm_xargs": {"target_token": -1}},
                             timeout=60)
        failed = httpx.post(f"{base_url}/v1/completions", json=body | {"vllm_xargs": {"explode": 1}}, timeout=60)
        after = httpx.post(f"{base_url}/v1/completions", json=body, timeout=60)
    assert forced.json()["choices"][0]["token_ids"] == [67] * 5, forced.text
    assert plain.json()["choices"][0]["token_ids"] == cached_hf_greedy(llama_dir, tuple(prompts[0]), 5)
    assert chat.json()["choices"][0]["token_ids"] == [68] * 3, chat.text
    assert refused.status_code == 400, refused.text
    assert "target_token must be a non-negative integer, got -1" in refused.json()["error"]["message"]
    # A 5xx body names no internals (deploy/errors.py): the server's log has the message.
    assert failed.status_code == 500, failed.text
    assert "RaisingLogitsProcessor raised in apply: KeyError: 'boom'" in (tmp_path / "server.log").read_text()
    assert after.json()["choices"][0]["token_ids"] == plain.json()["choices"][0]["token_ids"]


def test_engine_start_refuses_what_it_cannot_run(llama_dir):
    def config(**kwargs):
        return EngineArgs(model=str(llama_dir), **kwargs).create_engine_config()

    with pytest.raises(ValueError, match="'no_such_module:Processor' cannot be imported"):
        config(logits_processors=["no_such_module:Processor"])
    with pytest.raises(ValueError, match="is not a subclass of raylm.engine.logits_processor.LogitsProcessor"):
        config(logits_processors=["collections:OrderedDict"])
    with pytest.raises(ValueError, match="not supported with speculative decoding"):
        config(logits_processors=[DummyLogitsProcessor],
               speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2})

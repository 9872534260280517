"""AsyncLLMEngine: concurrent streams equal offline generation; deltas, stop strings,
aborts, per-request failures and engine death behave as documented."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from engine_checks import assert_engine_idle
from raylm.engine.arg_utils import EngineArgs
from raylm.engine.async_llm_engine import AsyncEngineDeadError, AsyncLLMEngine
from raylm.engine.llm import LLM
from raylm.engine.sampling_params import RequestOutputKind, SamplingParams

ENGINE_KWARGS = dict(num_gpu_blocks_override=128, disable_log_stats=True)
PROMPTS = ["The quick brown fox", "Paged attention stores", "Hello, world!", "for i in range(10):",
           "Ray places one worker", "Once upon a time"]


@pytest.fixture(scope="module")
def reference(llama_dir: Path) -> dict[str, str]:
    """Greedy texts of `LLM.generate`, the offline path the async engine must match."""
    llm = LLM(str(llama_dir), **ENGINE_KWARGS)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    llm.shutdown()
    return {o.prompt: o.outputs[0].text for o in outputs}


def _engine(llama_dir: Path, **overrides) -> AsyncLLMEngine:
    return AsyncLLMEngine.from_engine_args(EngineArgs(model=str(llama_dir), **{**ENGINE_KWARGS, **overrides}))


async def _collect(engine: AsyncLLMEngine, prompt, params: SamplingParams, request_id: str) -> list:
    return [output async for output in engine.generate(prompt, params, request_id)]


def _greedy(kind: RequestOutputKind = RequestOutputKind.CUMULATIVE, **kwargs) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "max_tokens": 24, "ignore_eos": True, "output_kind": kind, **kwargs})


def test_concurrent_streams_match_offline_generate_in_every_output_kind(llama_dir, reference):
    engine = _engine(llama_dir)

    async def main():
        jobs = [_collect(engine, prompt, _greedy(kind), f"{kind.name}-{i}")
                for i, prompt in enumerate(PROMPTS) for kind in RequestOutputKind]
        return await asyncio.gather(*jobs)

    results = asyncio.run(main())
    engine.shutdown()
    for index, outputs in enumerate(results):
        prompt, kind = PROMPTS[index // 3], list(RequestOutputKind)[index % 3]
        assert outputs[-1].finished and all(not o.finished for o in outputs[:-1])
        if kind == RequestOutputKind.DELTA:
            text = "".join(o.outputs[0].text for o in outputs if o.outputs)
            assert sum(len(o.outputs[0].token_ids) for o in outputs if o.outputs) == 24
        else:
            text = outputs[-1].outputs[0].text
        assert text == reference[prompt], (prompt, kind)
        # One output per step, fewer when a reader falls behind (it gets them merged).
        assert len(outputs) == 1 if kind == RequestOutputKind.FINAL_ONLY else 1 <= len(outputs) <= 24


def test_a_reader_that_falls_behind_gets_the_queued_outputs_as_one(llama_dir, reference):
    # vLLM's output collector: deltas are joined, a cumulative output replaces older ones.
    engine = _engine(llama_dir)
    prompt = PROMPTS[1]

    async def main():
        streams = {kind: await engine.add_request(kind.name, prompt, _greedy(kind, n=2, temperature=1.0, seed=4))
                   for kind in (RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE)}
        # Another request read as it goes, so every step's outputs wait in the two queues.
        steps = await _collect(engine, prompt, _greedy(RequestOutputKind.DELTA), "pacer")
        late = {kind: [o async for o in stream] for kind, stream in streams.items()}
        eager = await _collect(engine, prompt, _greedy(RequestOutputKind.CUMULATIVE, n=2, temperature=1.0, seed=4),
                               "eager")
        return len(steps), late, eager

    num_steps, late, eager = asyncio.run(main())
    engine.shutdown()
    assert num_steps > 1
    for kind, outputs in late.items():
        assert len(outputs) == 1 and outputs[0].finished, kind
        got = [(c.index, c.text, list(c.token_ids), c.finish_reason) for c in outputs[0].outputs]
        want = [(c.index, c.text, list(c.token_ids), c.finish_reason) for c in eager[-1].outputs]
        assert got == want, kind


def test_delta_stream_never_sends_text_that_a_stop_string_removes(llama_dir, reference):
    prompt = PROMPTS[0]
    full = reference[prompt]
    stop = full[6:10]  # four characters that appear mid-output
    expected = full[:full.index(stop)]
    engine = _engine(llama_dir)
    outputs = asyncio.run(_collect(engine, prompt, _greedy(RequestOutputKind.DELTA, stop=[stop]), "stop"))
    engine.shutdown()
    streamed = ""
    for output in outputs:
        streamed += output.outputs[0].text
        assert expected.startswith(streamed), "a delta held text past the stop string"
    assert streamed == expected
    assert outputs[-1].outputs[0].finish_reason == "stop" and outputs[-1].outputs[0].stop_reason == stop


@pytest.mark.parametrize("n", [1, 3])
def test_leaving_a_stream_early_aborts_the_request_and_frees_its_blocks(llama_dir, n):
    engine = _engine(llama_dir)

    async def main():
        stream = await engine.add_request("early", "Hello", SamplingParams(n=n, temperature=0 if n == 1 else 1.0,
                                                                           max_tokens=200, ignore_eos=True))
        async for output in stream:
            if len(output.outputs[0].token_ids) >= 3:
                break
        await stream.aclose()
        # A second request proves the loop went on and applied the abort between steps.
        await _collect(engine, "Hi", _greedy(), "after")
        return engine.engine.has_unfinished_requests()

    assert asyncio.run(main()) is False
    assert_engine_idle(engine.engine)
    engine.shutdown()


def test_bad_request_fails_alone_while_others_finish(llama_dir, reference):
    engine = _engine(llama_dir)

    async def main():
        good = asyncio.create_task(_collect(engine, PROMPTS[1], _greedy(), "good"))
        with pytest.raises(ValueError, match="outside the vocabulary"):
            await _collect(engine, [10**6], _greedy(), "bad-token")
        with pytest.raises(ValueError, match="context length"):
            await _collect(engine, [5] * 300, _greedy(), "too-long")
        return await good

    outputs = asyncio.run(main())
    assert outputs[-1].outputs[0].text == reference[PROMPTS[1]]
    assert not engine.errored
    engine.shutdown()


def test_detokenizer_error_fails_only_its_request(llama_dir, reference, monkeypatch):
    from raylm.engine import detokenizer

    original_step = detokenizer.IncrementalDetokenizer.step
    original_init = detokenizer.IncrementalDetokenizer.__init__

    def init(self, tokenizer, prompt_token_ids, *args, **kwargs):
        original_init(self, tokenizer, prompt_token_ids, *args, **kwargs)
        self.poisoned = prompt_token_ids[-1] == 7  # the marker prompt below ends with token 7

    def step(self, token_id):
        if getattr(self, "poisoned", False):
            raise RuntimeError("detokenizer bug")
        return original_step(self, token_id)

    monkeypatch.setattr(detokenizer.IncrementalDetokenizer, "__init__", init)
    monkeypatch.setattr(detokenizer.IncrementalDetokenizer, "step", step)
    engine = _engine(llama_dir)

    async def main():
        good = asyncio.create_task(_collect(engine, PROMPTS[2], _greedy(), "good"))
        with pytest.raises(RuntimeError, match="detokenizer bug"):
            await _collect(engine, [5, 6, 7], _greedy(), "poisoned")
        return await good

    outputs = asyncio.run(main())
    assert outputs[-1].outputs[0].text == reference[PROMPTS[2]]
    assert not engine.errored and not engine.engine.has_unfinished_requests()
    engine.shutdown()


def test_engine_failure_fails_every_waiter_and_health(llama_dir, monkeypatch):
    engine = _engine(llama_dir)
    calls = {"n": 0}
    original = engine.engine.executor.execute_model

    def failing(request):
        calls["n"] += 1
        if calls["n"] > 3:
            raise RuntimeError("worker died")
        return original(request)

    monkeypatch.setattr(engine.engine.executor, "execute_model", failing)

    async def main():
        jobs = [_collect(engine, prompt, _greedy(), f"r{i}") for i, prompt in enumerate(PROMPTS)]
        results = await asyncio.gather(*jobs, return_exceptions=True)
        with pytest.raises(AsyncEngineDeadError):
            await engine.check_health()
        with pytest.raises(AsyncEngineDeadError):
            await _collect(engine, "Hello", _greedy(), "late")
        return results

    results = asyncio.run(main())
    assert all(isinstance(r, AsyncEngineDeadError) for r in results), results
    assert engine.errored


def test_event_loop_stays_responsive_while_the_engine_steps(llama_dir):
    engine = _engine(llama_dir)

    async def main():
        loop = asyncio.get_running_loop()
        gaps: list[float] = []
        job = asyncio.ensure_future(asyncio.gather(*[
            _collect(engine, prompt, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True), f"r{i}")
            for i, prompt in enumerate(PROMPTS)]))
        last = loop.time()
        while not job.done():
            await asyncio.sleep(0.001)
            now = loop.time()
            gaps.append(now - last)
            last = now
        await job
        return gaps

    gaps = asyncio.run(main())
    engine.shutdown()
    # Steps run in a worker thread: the loop wakes many times during generation.
    assert len(gaps) > 10


def _count_steps(engine: AsyncLLMEngine) -> dict[str, int]:
    """Counts the engine's steps (the async loop calls `engine.engine.step`)."""
    counter = {"steps": 0}
    original = engine.engine.step

    def step():
        counter["steps"] += 1
        return original()

    engine.engine.step = step
    return counter


async def _steps_until_idle(engine: AsyncLLMEngine, counter: dict[str, int], start: int) -> int:
    """Waits (at most 10 s) until the engine holds no request; returns the steps taken since `start`."""
    for _ in range(1000):
        if not engine.engine.has_unfinished_requests() and not engine._pending_aborts:
            return counter["steps"] - start
        await asyncio.sleep(0.01)
    raise AssertionError(f"the engine still runs a request after {counter['steps'] - start} steps")


@pytest.mark.parametrize("how", ["aclose", "drop", "cancel"])
def test_closing_a_stream_before_reading_it_aborts_the_request(llama_dir, how):
    import threading

    engine = _engine(llama_dir)
    counter = _count_steps(engine)
    # The step thread steps on its own: hold its first step until the stream is closed,
    # so the waiter below is still waiting (no output has arrived) when it is cancelled.
    counted_step, release = engine.engine.step, threading.Event()

    def held_step():
        release.wait(10)
        return counted_step()

    engine.engine.step = held_step

    async def main():
        stream = await engine.add_request("unread", "Hello",
                                          SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
        start = counter["steps"]
        if how == "aclose":
            await stream.aclose()
        elif how == "drop":
            del stream
        else:
            waiter = asyncio.ensure_future(stream.__anext__())
            del stream
            await asyncio.sleep(0)  # the waiter is inside queue.get() now
            waiter.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiter
        # Behind the abort that dropping the stream queued on the loop (callbacks run in
        # order): releasing the step thread at once let it race that callback.
        asyncio.get_running_loop().call_soon(release.set)
        return await _steps_until_idle(engine, counter, start)

    # The abort is applied before the next step, so at most the step already under way
    # runs (200 would run if it were not).
    assert asyncio.run(main()) <= 1
    assert_engine_idle(engine.engine)
    assert engine.num_unfinished_requests == 0
    engine.shutdown()


def test_a_reused_request_id_never_gets_the_aborted_requests_outputs(llama_dir):
    import threading

    engine = _engine(llama_dir)
    old_prompt, new_prompt = [5, 6, 7, 8, 9, 10], [40, 41, 42]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    original_step = engine.engine.step
    gate = {"armed": False}
    entered, release = threading.Event(), threading.Event()

    def gated_step():
        # Holds one step in the engine thread until the test has aborted and re-added.
        if gate["armed"]:
            gate["armed"] = False
            entered.set()
            release.wait(10)
        return original_step()

    engine.engine.step = gated_step

    async def main():
        loop = asyncio.get_running_loop()
        old = await engine.add_request("reused", {"prompt_token_ids": old_prompt},
                                       SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
        await old.__anext__()
        gate["armed"] = True
        assert await loop.run_in_executor(None, entered.wait, 10)
        # The engine thread is inside a step that will output a token of the old request.
        await engine.abort("reused")
        adding = asyncio.ensure_future(engine.add_request("reused", {"prompt_token_ids": new_prompt}, params))
        await asyncio.sleep(0)  # the new request is registered under the old id
        release.set()
        new = await adding
        outputs = [output async for output in new]
        reference = [output async for output in engine.generate({"prompt_token_ids": new_prompt}, params, "fresh")]
        return outputs, reference

    outputs, reference = asyncio.run(main())
    assert all(o.prompt_token_ids == new_prompt and o.request_id == "reused" for o in outputs), \
        [o.prompt_token_ids for o in outputs]
    assert outputs[-1].finished and outputs[-1].outputs[0].token_ids == reference[-1].outputs[0].token_ids
    # One output per step, fewer if the reader fell behind (queued outputs come merged).
    assert 1 <= len(outputs) <= 8
    assert_engine_idle(engine.engine)
    engine.shutdown()

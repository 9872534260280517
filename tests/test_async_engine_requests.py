"""How `AsyncLLMEngine` takes requests in: adding them on the engine's thread (never the
event loop's), a beam search's beams entering the engine together and leaving it when
the search is cancelled, vLLM 0.4's `use_beam_search` through `generate`, and
`is_running` as vLLM's `AsyncLLM` has it."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from engine_checks import assert_engine_idle
from raylm.engine import LLM, BeamSearchParams, SamplingParams
from raylm.engine.arg_utils import EngineArgs
from raylm.engine.async_llm_engine import AsyncEngineDeadError, AsyncLLMEngine

PROMPT = [5, 17, 300, 42, 9, 77]
ENGINE_KWARGS = dict(num_gpu_blocks_override=128, disable_log_stats=True, dtype="float32")


@pytest.fixture
def engine(llama_dir: Path):
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(llama_dir), **ENGINE_KWARGS))
    yield engine
    engine.shutdown()


def _spy(obj, name: str, record) -> None:
    """Calls `record(*args)` before each call of the real `obj.name`."""
    original = getattr(obj, name)

    def spied(*args, **kwargs):
        record(*args)
        return original(*args, **kwargs)

    setattr(obj, name, spied)


def test_requests_are_added_on_the_engines_thread_not_the_event_loops(engine):
    """Adding tokenizes and fans out n samples: an n=16384 request held the loop 0.84 s."""
    adding_threads: set[int] = set()
    _spy(engine.engine, "add_request", lambda *args: adding_threads.add(threading.get_ident()))

    async def main() -> int:
        stream = await engine.add_request("text", "Hello, world!", SamplingParams(max_tokens=2))
        async for _ in stream:
            pass
        fan_out = await engine.add_request("fan-out", PROMPT, SamplingParams(n=64, max_tokens=1))
        async for _ in fan_out:
            pass
        return threading.get_ident()

    loop_thread = asyncio.run(main())
    assert adding_threads and loop_thread not in adding_threads
    assert_engine_idle(engine.engine)


def test_each_beam_search_step_enters_the_engine_as_one_batch(engine):
    """Every engine step of a lone beam search holds all the beams of one search step
    (1 at the first, then beam_width), never a part of them."""
    k = 4
    batch_sizes: list[int] = []
    _spy(engine.engine, "step", lambda: batch_sizes.append(len(engine.engine.scheduler.requests)))

    async def main():
        return await engine.beam_search(PROMPT, "beams", BeamSearchParams(beam_width=k, max_tokens=6))

    result = asyncio.run(main())
    assert len(result.sequences) == k
    assert batch_sizes[0] == 1 and set(batch_sizes) == {1, k}, batch_sizes
    assert_engine_idle(engine.engine)


def test_cancelling_a_beam_search_aborts_its_beams(engine):
    async def main():
        params = BeamSearchParams(beam_width=4, max_tokens=200, ignore_eos=True)
        search = asyncio.ensure_future(engine.beam_search(PROMPT, "cancelled", params))
        while engine.engine.engine_core.num_generation_tokens_total < 20:
            await asyncio.sleep(0.01)
        search.cancel()
        with pytest.raises(asyncio.CancelledError):
            await search
        # The aborts reach the engine at its next step boundary.
        for _ in range(200):
            if not engine.engine.has_unfinished_requests() and not engine._pending_aborts:
                break
            await asyncio.sleep(0.01)
        return engine.engine.engine_core.num_generation_tokens_total

    generated = asyncio.run(main())
    assert generated < 4 * 100
    assert_engine_idle(engine.engine)


def test_use_beam_search_through_generate_equals_llm_generate(engine, llama_dir):
    params = SamplingParams(use_beam_search=True, best_of=3, n=2, temperature=0, max_tokens=6)
    with LLM(str(llama_dir), **ENGINE_KWARGS) as llm:
        expected = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0]

    async def main():
        return [output async for output in engine.generate({"prompt_token_ids": PROMPT}, params, "legacy")]

    (output,) = asyncio.run(main())
    assert output.finished and output.prompt_token_ids == PROMPT
    assert [c.token_ids for c in output.outputs] == [c.token_ids for c in expected.outputs]
    assert [c.text for c in output.outputs] == [c.text for c in expected.outputs]
    assert_engine_idle(engine.engine)


def test_abort_stops_a_use_beam_search_request_by_its_id(engine):
    # Its beams run under ids of their own: abort(request_id) found nothing to stop, and the
    # search ran on to max_tokens.
    params = SamplingParams(use_beam_search=True, best_of=4, temperature=0, max_tokens=200, ignore_eos=True)

    async def main():
        stream = await engine.add_request("searched", PROMPT, params)
        while engine.engine.engine_core.num_generation_tokens_total < 20:
            await asyncio.sleep(0.01)
        await engine.abort("searched")
        outputs = [output async for output in stream]  # it ends without a final output
        for _ in range(200):
            if not engine.engine.has_unfinished_requests() and not engine._pending_aborts:
                break
            await asyncio.sleep(0.01)
        return outputs, engine.engine.engine_core.num_generation_tokens_total

    outputs, generated = asyncio.run(main())
    assert outputs == [] and generated < 4 * 100
    assert_engine_idle(engine.engine)


def test_a_second_use_beam_search_request_of_a_running_id_is_refused_at_once(engine):
    # It was refused a step later, naming one of the first search's beams.
    params = SamplingParams(use_beam_search=True, best_of=2, temperature=0, max_tokens=4)

    async def main():
        first = await engine.add_request("twice", PROMPT, params)
        with pytest.raises(ValueError, match="request_id 'twice' is already running"):
            await engine.add_request("twice", PROMPT, params)
        with pytest.raises(ValueError, match="request_id 'twice' is already running"):
            await engine.add_request("twice", PROMPT, SamplingParams(max_tokens=2))
        (output,) = [output async for output in first]
        again = await engine.add_request("twice", PROMPT, params)  # free once it ended
        return output, [output async for output in again]

    output, again = asyncio.run(main())
    assert output.finished and len(again) == 1 and again[0].outputs[0].token_ids == output.outputs[0].token_ids
    assert_engine_idle(engine.engine)


def test_a_bad_beam_search_prompt_is_refused_when_added(engine):
    params = SamplingParams(use_beam_search=True, best_of=2, temperature=0, max_tokens=4)

    async def main():
        with pytest.raises(ValueError):
            await engine.add_request("bad", [10**9], params)  # outside the vocabulary

    asyncio.run(main())
    assert_engine_idle(engine.engine)


def test_is_running_from_construction_until_shutdown(engine):
    assert engine.is_running and not engine.errored

    async def main():
        stream = await engine.add_request("r", PROMPT, SamplingParams(max_tokens=2))
        async for _ in stream:
            pass
        assert engine.is_running

    asyncio.run(main())
    engine.shutdown()
    assert not engine.is_running


def test_is_running_turns_false_when_the_loop_dies(engine, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("worker died")

    monkeypatch.setattr(engine.engine.executor, "execute_model", broken)

    async def main():
        with pytest.raises(AsyncEngineDeadError):
            async for _ in engine.generate(PROMPT, SamplingParams(max_tokens=2), "dies"):
                pass

    asyncio.run(main())
    assert engine.errored and not engine.is_running

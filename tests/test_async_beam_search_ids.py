"""Request ids of `AsyncLLMEngine` beam searches: a search's id is taken while it runs, as a
plain request's is (a second request of it is refused with a ValueError naming it), its
beams run under ids no caller can use, and `abort(request_id)` frees the id at once. The
beams equal the offline `LLM.beam_search` (itself checked against Hugging Face in
test_beam_search.py), and every KV block is back in the pool after each test."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from engine_checks import assert_engine_idle
from raylm.engine import LLM, BeamSearchParams, SamplingParams
from raylm.engine.arg_utils import EngineArgs
from raylm.engine.async_llm_engine import AsyncLLMEngine

PROMPT = [5, 17, 300, 42, 9, 77]
OTHER_PROMPT = [400, 8, 61]
ENGINE_KWARGS = dict(num_gpu_blocks_override=128, disable_log_stats=True, dtype="float32")
PARAMS = BeamSearchParams(beam_width=2, max_tokens=6)
LEGACY = SamplingParams(use_beam_search=True, best_of=2, n=2, temperature=0, max_tokens=6)
LONG = BeamSearchParams(beam_width=2, max_tokens=200, ignore_eos=True)


@pytest.fixture(scope="module")
def offline(llama_dir: Path) -> dict[str, list[list[int]]]:
    """The offline engine's beams (token ids, best first) of each prompt."""
    with LLM(str(llama_dir), **ENGINE_KWARGS) as llm:
        outputs = llm.beam_search([{"prompt_token_ids": p} for p in (PROMPT, OTHER_PROMPT)], PARAMS)
        legacy = llm.generate([{"prompt_token_ids": PROMPT}], LEGACY, use_tqdm=False)[0]
    return {"prompt": [s.tokens for s in outputs[0].sequences], "other": [s.tokens for s in outputs[1].sequences],
            "legacy": [list(c.token_ids) for c in legacy.outputs]}


@pytest.fixture
def engine(llama_dir: Path):
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(llama_dir), **ENGINE_KWARGS))
    yield engine
    engine.shutdown()


def _tokens(result) -> list[list[int]]:
    return [s.tokens for s in result.sequences]


async def _until_generated(engine: AsyncLLMEngine, tokens: int) -> None:
    start = engine.num_generation_tokens_total
    while engine.num_generation_tokens_total < start + tokens:
        await asyncio.sleep(0.005)


async def _until_idle(engine: AsyncLLMEngine) -> None:
    """Aborts reach the engine at its next step boundary."""
    for _ in range(500):
        if not engine.engine.has_unfinished_requests() and not engine._pending_aborts:
            return
        await asyncio.sleep(0.01)


def test_a_second_beam_search_of_a_running_id_is_refused_naming_it(engine, offline):
    # Both searches ran, and the second failed a step later naming a beam ('b-beam0-0').
    async def main():
        first = asyncio.ensure_future(engine.beam_search(PROMPT, "b", PARAMS))
        await asyncio.sleep(0)  # the first search holds its id
        with pytest.raises(ValueError, match=r"^request_id 'b' is already running\.$"):
            await engine.beam_search(OTHER_PROMPT, "b", PARAMS)
        with pytest.raises(ValueError, match=r"^request_id 'b' is already running\.$"):
            await engine.add_request("b", PROMPT, SamplingParams(max_tokens=2))
        with pytest.raises(ValueError, match=r"^request_id 'b' is already running\.$"):
            await engine.add_request("b", PROMPT, LEGACY)
        result = await first
        again = await engine.beam_search(OTHER_PROMPT, "b", PARAMS)  # free once it ended
        return result, again

    result, again = asyncio.run(main())
    assert _tokens(result) == offline["prompt"] and _tokens(again) == offline["other"]
    assert_engine_idle(engine.engine)


def test_a_beam_search_of_a_running_plain_requests_id_is_refused(engine, offline):
    async def main():
        plain = await engine.add_request("p", PROMPT, SamplingParams(max_tokens=50, ignore_eos=True))
        with pytest.raises(ValueError, match=r"^request_id 'p' is already running\.$"):
            await engine.beam_search(OTHER_PROMPT, "p", PARAMS)
        outputs = [output async for output in plain]
        return outputs, await engine.beam_search(OTHER_PROMPT, "p", PARAMS)

    outputs, result = asyncio.run(main())
    assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 50
    assert _tokens(result) == offline["other"]
    assert_engine_idle(engine.engine)


@pytest.mark.parametrize("api", ["beam_search", "use_beam_search"])
def test_user_ids_never_collide_with_a_searchs_beams(engine, offline, api):
    # The beams of search 's' ran as requests 's-beam{step}-{i}': a user's request of such an
    # id failed the search ("already running"), and aborting it ended one of its beams.
    names = [f"s-beam{step}-{i}" for step in range(PARAMS.max_tokens) for i in range(PARAMS.beam_width)]

    async def main():
        plain = [await engine.add_request(name, PROMPT, SamplingParams(max_tokens=40, ignore_eos=True))
                 for name in names]
        if api == "beam_search":
            search = asyncio.ensure_future(engine.beam_search(PROMPT, "s", PARAMS))
        else:
            stream = await engine.add_request("s", PROMPT, LEGACY)
            search = asyncio.ensure_future(anext(stream))
        await _until_generated(engine, 3 * len(names))
        for name in names[len(names) // 2:]:
            await engine.abort(name)
        result = await search
        return result, [[output async for output in stream] for stream in plain]

    result, plain_outputs = asyncio.run(main())
    if api == "beam_search":
        assert _tokens(result) == offline["prompt"]
    else:
        assert result.request_id == "s" and [list(c.token_ids) for c in result.outputs] == offline["legacy"]
    finished = [outputs for outputs in plain_outputs if outputs and outputs[-1].finished]
    assert len(finished) >= len(names) // 2
    assert all(len(outputs[-1].outputs[0].token_ids) == 40 for outputs in finished)
    assert_engine_idle(engine.engine)


def test_abort_stops_a_beam_search_and_frees_its_id_at_once(engine, offline):
    # abort('r') found no request of that id: the search ran on to max_tokens.
    async def main():
        search = asyncio.ensure_future(engine.beam_search(PROMPT, "r", LONG))
        await _until_generated(engine, 10)
        await engine.abort("r")
        again = await engine.beam_search(PROMPT, "r", PARAMS)  # before the first has even seen its abort
        with pytest.raises(asyncio.CancelledError):
            await search
        await _until_idle(engine)
        return again, engine.num_generation_tokens_total

    again, generated = asyncio.run(main())
    assert _tokens(again) == offline["prompt"] and generated < 100
    assert_engine_idle(engine.engine)


def test_a_use_beam_search_id_is_reusable_right_after_its_abort(engine, offline):
    # The re-added search was refused for 'r-beam0-0', a beam of the aborted one that its
    # task had not cancelled yet.
    async def main():
        first = await engine.add_request("r", PROMPT, SamplingParams(use_beam_search=True, best_of=2, temperature=0,
                                                                     max_tokens=200, ignore_eos=True))
        await engine.abort("r")
        second = await engine.add_request("r", PROMPT, LEGACY)
        return [o async for o in first], [o async for o in second]

    first, second = asyncio.run(main())
    assert first == [] and [list(c.token_ids) for c in second[0].outputs] == offline["legacy"]
    assert_engine_idle(engine.engine)


def test_an_abort_while_a_search_is_being_added_never_touches_the_next_one_of_its_id(engine, offline):
    # The aborted search, resuming after its re-add, took the id back over: it ran to the
    # end, and the new one could no longer be aborted by its id.
    async def main():
        adding = asyncio.ensure_future(engine.add_request("q", PROMPT, LEGACY))
        await asyncio.sleep(0)  # its first step is being added
        await engine.abort("q")
        second = await engine.add_request("q", PROMPT, LEGACY)
        first = await adding
        return [o async for o in first], [o async for o in second]

    first, second = asyncio.run(main())
    assert first == [] and [list(c.token_ids) for c in second[0].outputs] == offline["legacy"]
    assert_engine_idle(engine.engine)

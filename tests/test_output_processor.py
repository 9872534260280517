"""The OutputProcessor on its own: stop strings with holdback against a plain-string
reference, and work per step that does not grow with the output."""

from __future__ import annotations

import random

import pytest

from raylm.engine.detokenizer import IncrementalDetokenizer
from raylm.engine.output_processor import EngineCoreOutput, OutputProcessor, ParentRequest
from raylm.engine.sampling_params import RequestOutputKind, SamplingParams
from raylm.engine.tokenizer import get_tokenizer


@pytest.fixture(scope="module")
def tokenizer(llama_dir):
    return get_tokenizer(str(llama_dir))


def _run(processor: OutputProcessor, request_id: str, params: SamplingParams, token_ids: list[int],
         finish_at_end: bool = True):
    """Feeds the tokens one step at a time; returns the outputs and the ids the core was
    told to stop."""
    parent = ParentRequest(request_id, None, [5, 6, 7], params, arrival_time=0.0)
    (child_id,) = processor.add_request(parent, params)
    outputs, stopped = [], []
    for index, token_id in enumerate(token_ids):
        last = finish_at_end and index == len(token_ids) - 1
        core_output = EngineCoreOutput(child_id, [token_id], [-0.5], finish_reason="length" if last else None)
        step_outputs, to_stop, failed = processor.process_outputs([core_output])
        assert not failed
        outputs += step_outputs
        stopped += to_stop
        if to_stop or last:
            break
    return outputs, stopped


def _reference_cut(pieces: list[str], stop: list[str], include: bool) -> tuple[str, str | None, int]:
    """The text a client must see: grown one character at a time, cut at the first stop
    string that appears (the first in `stop` among those that complete at the same
    character); also the stop string and the index of the piece that completed it."""
    text = ""
    for position, piece in enumerate(pieces):
        for char in piece:
            text += char
            for stop_str in stop:
                if text.endswith(stop_str):
                    cut = len(text) if include else len(text) - len(stop_str)
                    return text[:cut], stop_str, position
    return text, None, len(pieces)


@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE,
                                  RequestOutputKind.FINAL_ONLY])
def test_stop_strings_cut_exactly_and_deltas_never_show_what_is_cut(tokenizer, kind):
    rng = random.Random(int(kind))
    vocab = [i for i in range(4, 512)]
    processor = OutputProcessor(tokenizer)
    for trial in range(150):
        token_ids = [rng.choice(vocab) for _ in range(rng.randint(1, 25))]
        # The text each token adds, from a detokenizer of its own (checked against HF's
        # decode elsewhere): this test is about what the processor does with the text.
        detokenizer = IncrementalDetokenizer(tokenizer, [5, 6, 7], True, True)
        pieces = [detokenizer.step(token_id) for token_id in token_ids]
        text = "".join(pieces)
        # Stop strings taken from the text itself (so they are found), or random ones.
        stop = []
        for _ in range(rng.randint(1, 3)):
            if text and rng.random() < 0.7:
                start = rng.randrange(len(text))
                stop.append(text[start:start + rng.randint(1, 6)])
            else:
                stop.append("".join(rng.choice("ab\n ") for _ in range(rng.randint(1, 4))))
        stop = [s for s in stop if s]
        include = rng.random() < 0.5
        params = SamplingParams(stop=stop, include_stop_str_in_output=include, output_kind=kind)
        outputs, stopped = _run(processor, f"r{trial}", params, token_ids)
        expected, stop_reason, stop_position = _reference_cut(pieces, stop, include)
        completions = [o.outputs[0] for o in outputs]
        if kind == RequestOutputKind.DELTA:
            seen = ""
            for completion in completions:
                seen += completion.text
                assert expected.startswith(seen), f"a delta showed text past the cut: {seen!r} vs {expected!r}"
            assert seen == expected
        else:
            assert completions[-1].text == expected
        assert completions[-1].finish_reason == ("stop" if stop_reason else "length")
        assert completions[-1].stop_reason == stop_reason
        # The core is told to stop the request when a stop string ends it before the core
        # itself would (here: the last token, which finishes by length).
        assert bool(stopped) == (stop_position < len(token_ids) - 1)
    assert not processor.has_unfinished_requests()


def _largest_buffer(processor: OutputProcessor, request_id: str, num_tokens: int) -> int:
    """Streams num_tokens in DELTA mode with a stop string that never matches; returns the
    most items the request's state held at once (tokens, text pieces, held-back chars)."""
    params = SamplingParams(stop=["\x00never"], logprobs=1, output_kind=RequestOutputKind.DELTA)
    parent = ParentRequest(request_id, None, [5, 6, 7], params, arrival_time=0.0)
    (child_id,) = processor.add_request(parent, params)
    state = processor.request_states[child_id]
    largest = 0
    rng = random.Random(num_tokens)
    from raylm.engine.step import TokenLogprobs
    for index in range(num_tokens):
        token_id = rng.randrange(4, 512)
        finish = "length" if index == num_tokens - 1 else None
        outputs, _, _ = processor.process_outputs([EngineCoreOutput(
            child_id, [token_id], [-1.0], new_logprobs=[TokenLogprobs(token_id, -1.0, 1)], finish_reason=finish)])
        assert len(outputs) <= 1 and (not outputs or len(outputs[0].outputs[0].token_ids) == 1)
        largest = max(largest, len(state.token_ids) + len(state.logprobs) + len(state.text._pieces)
                      + len(state.text._recent))
    return largest


def test_delta_streaming_work_per_step_does_not_grow_with_the_output(tokenizer):
    processor = OutputProcessor(tokenizer)
    short = _largest_buffer(processor, "short", 500)
    long = _largest_buffer(processor, "long", 4000)
    # What a step handles is bounded by the step's new tokens and the longest stop string,
    # whatever the length of the output so far.
    assert long == short and long <= 1 + 1 + len("\x00never")

"""`OutputProcessor`: the engine core's new tokens, turned into `RequestOutput`s.

The one place for incremental detokenization, stop strings with holdback, logprob entries
and the three output kinds (DELTA, CUMULATIVE, FINAL_ONLY), used by `LLMEngine`, `LLM`
and `AsyncLLMEngine` alike. Its work per step is proportional to the step's new tokens
(CUMULATIVE outputs aside, which hand out the whole output by definition): text is kept
as committed pieces plus a held-back tail no longer than the longest stop string, and a
DELTA stream keeps only what it has not sent yet.

Children of an `n > 1` / `best_of` request are separate engine requests; a `ParentRequest`
gathers them into one `RequestOutput` (best_of keeps the n with the highest cumulative
logprob, known only when all have finished).
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any

from raylm.engine.detokenizer import IncrementalDetokenizer, TokenTextCache
from raylm.engine.outputs import (CompletionOutput, Logprob, PoolingOutput, PoolingRequestOutput, RequestMetrics,
                                  RequestOutput)
from raylm.engine.pooling_params import PoolingParams
from raylm.engine.sampling_params import RequestOutputKind, SamplingParams
from raylm.engine.step import TokenLogprobs

logger = logging.getLogger(__name__)


@dataclass
class EngineCoreOutput:
    """What one step did for one request: no text, only tokens and numbers."""

    request_id: str
    new_token_ids: list[int]
    # Raw logprob of each new token (for the cumulative logprob).
    new_token_logprobs: list[float | None]
    # The top-k entries of each new token, when the request asked for logprobs.
    new_logprobs: list[TokenLogprobs] | None = None
    # Prompt positions scored this step (a prefill chunk), when asked for.
    new_prompt_logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    # A pooling request's pooled hidden state (float32, CPU), in its finishing output.
    pooling_output: Any = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class _TextStream:
    """The output text of one request: committed pieces plus a held-back tail.

    The last `len(longest stop string) - 1` characters stay held back (unless stop strings
    are kept in the output), since a stop string that completes later would cut them.
    """

    def __init__(self, stop: list[str], include_stop_str_in_output: bool, keep_all: bool) -> None:
        self.stop = stop
        self.include_stop = include_stop_str_in_output
        self._window = max((len(s) for s in stop), default=1) - 1
        # Pieces committed (all of them when keep_all, else those not yet taken).
        self._pieces: list[str] = []
        self._keep_all = keep_all
        self._num_taken = 0
        # The last `_window` characters of the text, and how many of them are uncommitted.
        self._recent = ""
        self._num_held = 0

    def append(self, text: str) -> str | None:
        """Adds new text; returns the stop string it completes, if any (the text is then cut)."""
        if not text:
            return None
        if not self.stop:
            self._pieces.append(text)
            return None
        window = self._recent + text
        committed = len(self._recent) - self._num_held
        found = self._first_stop(window)
        if found is not None:
            stop_str, index = found
            cut = index + len(stop_str) if self.include_stop else index
            self._commit(window[committed:cut])
            self._recent, self._num_held = "", 0
            return stop_str
        held = 0 if self.include_stop else min(self._window, len(window))
        self._commit(window[committed:len(window) - held])
        self._recent = window[max(0, len(window) - self._window):] if self._window else ""
        self._num_held = min(held, len(self._recent))
        return None

    def _first_stop(self, window: str) -> tuple[str, int] | None:
        """The stop string the new text completes first, and where it starts: the one that
        ends earliest (the first in `stop` among those ending at the same character), as if
        the text had come one character at a time. (vLLM takes the first in `stop` found
        anywhere in the new text, so when one token completes two stop strings the text it
        returns can hold the other one.)"""
        new_from = len(self._recent)
        best: tuple[str, int] | None = None
        best_end = len(window) + 1
        for stop_str in self.stop:
            index = window.find(stop_str, max(0, new_from - len(stop_str) + 1))
            if index != -1 and index + len(stop_str) < best_end:
                best, best_end = (stop_str, index), index + len(stop_str)
        return best

    def flush(self) -> None:
        """Commits the held-back tail (the request ended without a stop string)."""
        if self._num_held:
            self._commit(self._recent[len(self._recent) - self._num_held:])
        self._num_held = 0

    def _commit(self, text: str) -> None:
        if text:
            self._pieces.append(text)

    def take_new(self) -> str:
        """The committed text not taken before."""
        if self._keep_all:
            new = "".join(self._pieces[self._num_taken:])
            self._num_taken = len(self._pieces)
            return new
        new = "".join(self._pieces)
        self._pieces.clear()
        return new

    def text(self) -> str:
        assert self._keep_all
        if len(self._pieces) > 1:
            self._pieces[:] = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""


class RequestState:
    """One engine request (one sample) as the output processor tracks it."""

    def __init__(self, request_id: str, index: int, params: SamplingParams, tokenizer: Any,
                 prompt_token_ids: list[int], parent: "ParentRequest") -> None:
        self.request_id = request_id
        self.index = index
        self.parent = parent
        self.output_kind = parent.output_kind
        self.delta = self.output_kind == RequestOutputKind.DELTA
        self.want_logprobs = params.logprobs is not None
        # detokenize=False: token ids only, no text (vLLM's); stop strings were refused then.
        self.detokenizer = None if tokenizer is None or not params.detokenize else IncrementalDetokenizer(
            tokenizer, prompt_token_ids, params.skip_special_tokens, params.spaces_between_special_tokens)
        self.text = _TextStream(params.stop, params.include_stop_str_in_output, keep_all=not self.delta)
        # All tokens (and logprob entries), or in DELTA mode those not yet sent.
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, Logprob]] | None = [] if self.want_logprobs else None
        self.num_output_tokens = 0
        # None unless logprobs are asked for (or best_of ranks by it), as in vLLM V1.
        self.cumulative_logprob: float | None = 0.0 if params.needs_sampled_logprob else None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.finish_sent = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def completion(self) -> CompletionOutput:
        """This sample's CompletionOutput for the output kind; takes the DELTA backlog."""
        if self.delta:
            token_ids, self.token_ids = self.token_ids, []
            logprobs = self.logprobs
            if logprobs is not None:
                self.logprobs = []
            text = self.text.take_new()
        else:
            token_ids = list(self.token_ids)
            logprobs = list(self.logprobs) if self.logprobs is not None else None
            text = self.text.text()
        self.finish_sent = self.finished
        return CompletionOutput(self.index, text, token_ids, self.cumulative_logprob, logprobs,
                                self.finish_reason, self.stop_reason)

    def has_delta(self) -> bool:
        return bool(self.token_ids) or (self.finished and not self.finish_sent)


class ParentRequest:
    """The caller's request: one or more samples under one request id."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                 arrival_time: float, prompt_is_embeds: bool = False) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        # An embeddings prompt: prompt_token_ids are placeholders, no context for the detokenizer.
        self.prompt_is_embeds = prompt_is_embeds
        self.n = params.n
        self.best_of = params.best_of
        self.want_prompt_logprobs = params.prompt_logprobs is not None
        # Which n of best_of win is known only at the end: then the only output is the last.
        self.output_kind = params.output_kind if self.best_of == self.n else RequestOutputKind.FINAL_ONLY
        self.children: list[RequestState] = []
        self.num_finished = 0
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = [None] if self.want_prompt_logprobs else None
        self.prompt_logprobs_sent = False
        self.metrics = RequestMetrics(arrival_time=arrival_time)

    @property
    def finished(self) -> bool:
        return self.num_finished == len(self.children)

    def child_request_id(self, index: int, serial: int) -> str:
        """The engine's id of the `index`-th sample, given the parent's `serial` (unique in
        its OutputProcessor): vLLM's `{index}_{request_id}` (the request id alone for one
        sample), followed by `-{serial}`. No caller's id can collide with it: a child's id
        ends in its parent's serial, digits after the last '-', and a parent's children
        differ in the index before the first '_'. (The bare vLLM form collided: request
        "0_a" with the first child of request "a", n=2.)"""
        base = self.request_id if self.best_of == 1 else f"{index}_{self.request_id}"
        return f"{base}-{serial}"

    def make_output(self) -> RequestOutput | None:
        finished = self.finished
        if self.output_kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        children = self.children
        if finished and self.best_of > self.n:
            children = sorted(children, key=lambda c: c.cumulative_logprob, reverse=True)[:self.n]
        if self.output_kind == RequestOutputKind.DELTA:
            completions = [child.completion() for child in children if child.has_delta()]
            prompt_logprobs = None if self.prompt_logprobs_sent else self.prompt_logprobs
        else:
            completions = [child.completion() for child in children]
            prompt_logprobs = self.prompt_logprobs
        if self.best_of > self.n and finished:
            for index, completion in enumerate(completions):
                completion.index = index
        if not completions and not finished:
            return None
        self.prompt_logprobs_sent = True
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, prompt_logprobs,
                             completions, finished, self.metrics)


@dataclass
class _PoolingRequestState:
    """A pooling request as the output processor tracks it: no tokens, no text."""

    request_id: str
    parent: ParentRequest
    pooling_params: PoolingParams


class OutputProcessor:
    """Turns `EngineCoreOutput`s into `RequestOutput`s, request by request."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._token_text = TokenTextCache(tokenizer) if tokenizer is not None else None
        self.request_states: dict[str, RequestState] = {}
        self.parents: dict[str, ParentRequest] = {}
        # Numbers the parents, so that their children's ids never collide.
        self._serials = itertools.count()

    def add_request(self, parent: ParentRequest, params: SamplingParams) -> list[str]:
        """Registers the parent and its best_of children; returns the children's ids, which
        are the engine's own (unique whatever ids callers choose)."""
        self.parents[parent.request_id] = parent
        serial = next(self._serials)
        for index in range(parent.best_of):
            child_id = parent.child_request_id(index, serial)
            context = [] if parent.prompt_is_embeds else parent.prompt_token_ids
            state = RequestState(child_id, index, params, self.tokenizer, context, parent)
            parent.children.append(state)
            self.request_states[child_id] = state
        return [child.request_id for child in parent.children]

    def add_pooling_request(self, parent: ParentRequest, pooling_params: PoolingParams) -> str:
        """Registers a pooling request (one engine request, no text); returns its engine id."""
        self.parents[parent.request_id] = parent
        state = _PoolingRequestState(parent.child_request_id(0, next(self._serials)), parent, pooling_params)
        parent.children.append(state)
        self.request_states[state.request_id] = state
        return state.request_id

    def process_pooling_outputs(self, core_outputs: list[EngineCoreOutput], default_normalize: bool,
                                activations: dict[str, Any] | None = None
                                ) -> tuple[list[PoolingRequestOutput], list[str], dict[str, BaseException]]:
        """`process_outputs` for a pooling engine: each finished request's embedding or class
        probabilities (its PoolingParams applied to the pooled vector, with a classifier's
        `activations` by task). Nothing to stop, nothing fails here."""
        now = time.time()
        outputs = []
        for core_output in core_outputs:
            state = self.request_states.get(core_output.request_id)
            if state is None or core_output.pooling_output is None:
                continue
            parent = state.parent
            self.abort_requests([parent.request_id])  # done: forgotten
            parent.metrics.first_token_time = parent.metrics.finished_time = now
            parent.metrics.num_cached_tokens = core_output.num_cached_tokens
            data = state.pooling_params.apply(core_output.pooling_output, default_normalize, activations)
            outputs.append(PoolingRequestOutput(parent.request_id, PoolingOutput(data), parent.prompt_token_ids,
                                                True, parent.metrics))
        return outputs, [], {}

    def has_unfinished_requests(self) -> bool:
        return bool(self.parents)

    def get_num_unfinished_requests(self) -> int:
        return len(self.parents)

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        """Forgets the parent requests; returns their children's ids (for the engine core)."""
        child_ids = []
        for request_id in request_ids:
            parent = self.parents.pop(request_id, None)
            if parent is None:
                continue
            for child in parent.children:
                self.request_states.pop(child.request_id, None)
                child_ids.append(child.request_id)
        return child_ids

    def process_outputs(self, core_outputs: list[EngineCoreOutput]
                        ) -> tuple[list[RequestOutput], list[str], dict[str, BaseException]]:
        """Returns this step's RequestOutputs, the child requests the core must stop (a
        stop string ended them), and the parent requests that failed (their children must
        be aborted; they are already forgotten here)."""
        now = time.time()
        touched: dict[str, ParentRequest] = {}
        to_stop: list[str] = []
        failed: dict[str, BaseException] = {}
        for core_output in core_outputs:
            state = self.request_states.get(core_output.request_id)
            if state is None or state.parent.request_id in failed:
                continue
            parent = state.parent
            if state.finished:  # stopped by a string while the core ran one more step
                continue
            try:
                if self._update(state, core_output):
                    to_stop.append(state.request_id)
            except Exception as exc:  # noqa: BLE001 - a detokenizer bug fails its own request only
                logger.exception("Request %s failed while building its output.", parent.request_id)
                failed[parent.request_id] = exc
                continue
            if parent.metrics.first_token_time is None and core_output.new_token_ids:
                parent.metrics.first_token_time = now
            if state.finished:
                parent.num_finished += 1
            touched[parent.request_id] = parent
        outputs = []
        for request_id in failed:
            touched.pop(request_id, None)
        for parent in touched.values():
            if parent.finished:
                parent.metrics.finished_time = now
                self.abort_requests([parent.request_id])
            output = parent.make_output()
            if output is not None:
                outputs.append(output)
        for request_id in failed:
            to_stop.extend(self.abort_requests([request_id]))
        return outputs, to_stop, failed

    def _update(self, state: RequestState, core_output: EngineCoreOutput) -> bool:
        """Applies one core output; True when a stop string ended the request here."""
        parent = state.parent
        if core_output.new_prompt_logprobs and parent.prompt_logprobs is not None:
            parent.prompt_logprobs.extend(self._logprob_dict(e, state.detokenizer is not None)
                                          for e in core_output.new_prompt_logprobs)
        if core_output.num_cached_tokens > parent.metrics.num_cached_tokens:
            parent.metrics.num_cached_tokens = core_output.num_cached_tokens
        stopped_by_string = False
        # The EOS that ends a request is not part of its text, as in vLLM, even with
        # skip_special_tokens=False (tool-call parsers keep special tokens in the text).
        eos_position = len(core_output.new_token_ids) - 1 \
            if core_output.finish_reason == "stop" and core_output.stop_reason is None else -1
        for position, token_id in enumerate(core_output.new_token_ids):
            state.token_ids.append(token_id)
            state.num_output_tokens += 1
            if state.cumulative_logprob is not None:
                state.cumulative_logprob += core_output.new_token_logprobs[position]
            if state.logprobs is not None and core_output.new_logprobs is not None:
                state.logprobs.append(self._logprob_dict(core_output.new_logprobs[position],
                                                         state.detokenizer is not None))
            if state.detokenizer is not None and position != eos_position:
                stop_str = state.text.append(state.detokenizer.step(token_id))
                if stop_str is not None:
                    state.finish_reason, state.stop_reason = "stop", stop_str
                    stopped_by_string = True
                    break
        if not stopped_by_string and core_output.finished:
            state.finish_reason, state.stop_reason = core_output.finish_reason, core_output.stop_reason
        if state.finished:
            state.text.flush()
        parent.metrics.num_generation_tokens += len(core_output.new_token_ids)
        return stopped_by_string and not core_output.finished

    def _logprob_dict(self, entry: TokenLogprobs, decoded: bool = True) -> dict[int, Logprob]:
        """The entry's Logprobs; `decoded`: with each token's text (not with detokenize=False)."""
        text = self._token_text if decoded else None
        result = {entry.token_id: Logprob(entry.logprob, entry.rank, text(entry.token_id) if text else None)}
        for rank, (token_id, logprob) in enumerate(entry.top, start=1):
            if token_id not in result:
                result[token_id] = Logprob(logprob, rank, text(token_id) if text else None)
        return result

"""`StructuredOutputRequest`: one request's grammar and its matcher.

The matcher is the grammar's parse state over the request's output tokens: the engine core
advances it with each token it appends, and the scheduler asks it for the next token's
bitmask when the request is sampled. It follows the output tokens alone, which recompute
after a preemption keeps, so a preempted request resumes with its matcher as it was.

Under a reasoning parser (`params.reasoning_end_sequence`) the matcher starts after the
tokens that end the reasoning (one token, `</think>`, or several in a row, gpt-oss's header
`<|channel|>final<|message|>`; or `reasoning_implicit_end_token_id` where it comes first):
until then every token is allowed and none advances it, as in vLLM, so that the grammar
constrains the answer and not the thinking before it.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from raylm.engine.structured_output.params import StructuredOutputsParams

if TYPE_CHECKING:
    from raylm.engine.structured_output.manager import StructuredOutputManager


class StructuredOutputRequest:
    def __init__(self, manager: "StructuredOutputManager", params: StructuredOutputsParams, grammar: Future,
                 allowed_token_ids: list[int] | None = None) -> None:
        self.manager = manager
        self.params = params
        self.grammar = grammar
        # The request's SamplingParams.allowed_token_ids, which the sampler applies beside
        # the grammar's bitmask (sorted, distinct; None: every token).
        self.allowed_token_ids = None if allowed_token_ids is None else sorted(set(allowed_token_ids))
        self._matcher: Any = None
        self._stop_token_ids: frozenset[int] = frozenset()
        self.released = False
        # Set when no token could be sampled (see grammar_bitmask): the grammar allowed none
        # ("grammar"), or none of allowed_token_ids ("allowed_token_ids"); None otherwise.
        self.dead_end: str | None = None
        # False while the output is still reasoning: the grammar does not apply yet.
        self._end_sequence = params.reasoning_end_sequence
        self.reasoning_ended = self._end_sequence is None
        # The reasoning's last tokens, as many as the end sequence has: it ends when they are it.
        self._recent: deque[int] = deque(maxlen=len(self._end_sequence or ()))

    @property
    def is_ready(self) -> bool:
        """Whether the grammar has compiled (or failed: see `error`)."""
        return self.grammar.done()

    @property
    def error(self) -> BaseException | None:
        """Why the grammar did not compile, once it is done; None if it did."""
        if self.grammar.cancelled():
            return RuntimeError("The grammar's compile was cancelled (its deadline passed, or the engine is shutting down).")
        return self.grammar.exception()

    @property
    def matcher(self) -> Any:
        """xgrammar's matcher, made on first use (the grammar must be ready)."""
        if self._matcher is None:
            assert not self.released, "a released request has no matcher"
            import xgrammar as xgr

            self._matcher = xgr.GrammarMatcher(self.grammar.result())
            self._stop_token_ids = frozenset(self._matcher.stop_token_ids)
            self.manager.num_active_matchers += 1
        return self._matcher

    def accept_token(self, token_id: int) -> bool:
        """Advances the matcher over a sampled token; False if the grammar does not allow it.
        A token of the reasoning is not the grammar's: it is accepted as it is, and the
        reasoning's end (its last token) starts the grammar with the next one."""
        if not self.reasoning_ended:
            self._recent.append(token_id)
            self.reasoning_ended = token_id == self.params.reasoning_implicit_end_token_id \
                or tuple(self._recent) == self._end_sequence
            if self.reasoning_ended:
                self._recent.clear()
            return True
        return self.matcher.accept_token(token_id)

    def is_terminated_by(self, token_id: int) -> bool:
        """Whether the token just accepted ended the grammar (only a stop token, EOS, can):
        nothing may follow it."""
        return self.reasoning_ended and token_id in self._stop_token_ids and self.matcher.is_terminated()

    def release(self) -> None:
        """Drops the matcher (the request finished, was aborted or failed)."""
        if self._matcher is not None:
            self._matcher = None
            self.manager.num_active_matchers -= 1
        self.released = True

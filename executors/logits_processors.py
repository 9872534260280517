"""The sampling worker's custom logits processors and the batch their indices name.

vLLM's processors index a persistent batch: a request keeps its row from step to step
until the batch is condensed or reordered, and each step's `BatchUpdate` says what moved.
raylm's sampler has no persistent batch: each step's logits rows are the requests it
samples, in the step's order. `LogitsProcessors` keeps the row each request held in the
last step and describes the step's order as vLLM's updates would (requests that left,
those that joined, moves and swaps of the rest), so that after `update_state` index i is
the step's logits row i. A request that is not sampled in a step (preempted, or a prompt
chunk short of its end) leaves the batch and joins it again later, with its token lists.

It also keeps every running request's prompt and output token lists, from each step's
tokens, the lists `AddedRequest` hands out (the same list objects for the request's
life, so a processor holding one sees each new token).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from raylm.engine.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality
from raylm.engine.logits_processor_classes import LogitsProcessorClass
from raylm.engine.step import PLACEHOLDER_TOKEN_ID, ScheduledRequest

if TYPE_CHECKING:
    from raylm.engine.config import EngineConfig


class LogitsProcessorError(RuntimeError):
    """A custom logits processor raised: the step's requests fail, the engine goes on."""


@dataclass
class _RequestTokens:
    prompt: list[int] = field(default_factory=list)
    output: list[int] = field(default_factory=list)


class LogitsProcessors:
    """The loaded processors (one instance of each class), split as the sampler runs them."""

    def __init__(self, classes: Iterable[LogitsProcessorClass], engine_config: EngineConfig, device: torch.device,
                 is_pin_memory: bool) -> None:
        self.processors: list[tuple[str, LogitsProcessor]] = []
        for entry in classes:
            try:
                self.processors.append((entry.name, entry.cls(engine_config, device, is_pin_memory)))
            except Exception as error:
                raise RuntimeError(f"The logits processor {entry.name} could not be built "
                                   f"({type(error).__name__}: {error}).") from error
        self.non_argmax_invariant = [(name, p) for name, p in self.processors if not p.is_argmax_invariant()]
        self.argmax_invariant = [(name, p) for name, p in self.processors if p.is_argmax_invariant()]
        self._rows: list[int] = []  # the req_id at each index of the last step's batch
        # Rows a batch may have (a step samples at most max_num_seqs requests).
        self._max_rows = engine_config.scheduler_config.max_num_seqs
        self._tokens: dict[int, _RequestTokens] = {}

    # ---- token lists ---------------------------------------------------------------

    def track(self, requests: list[ScheduledRequest]) -> None:
        """Adds the step's tokens (placeholders filled) to the requests' lists; a
        (re)admitted request's lists are rebuilt, in place, from its context and tokens."""
        for scheduled in requests:
            assert scheduled.token_ids[-1] != PLACEHOLDER_TOKEN_ID, "the previous step's token must be on the host"
            tokens = self._tokens.get(scheduled.req_id)
            num_prompt = scheduled.num_prompt_tokens
            if tokens is None or scheduled.resumed:
                tokens = self._tokens.setdefault(scheduled.req_id, _RequestTokens())
                context = scheduled.context_token_ids or []
                assert len(context) == scheduled.num_computed_tokens, (
                    f"request {scheduled.req_id}: its lists need the {scheduled.num_computed_tokens} tokens before "
                    f"the step")
                everything = context + scheduled.token_ids
                tokens.prompt[:] = everything[:num_prompt]
                tokens.output[:] = everything[num_prompt:]
                continue
            start = scheduled.num_computed_tokens
            in_prompt = min(max(num_prompt - start, 0), len(scheduled.token_ids))
            if in_prompt:
                tokens.prompt.extend(scheduled.token_ids[:in_prompt])
            tokens.output.extend(scheduled.token_ids[in_prompt:])

    def forget(self, req_ids: Iterable[int]) -> None:
        """Drops the lists of requests that ended (they leave the batch at the next step)."""
        for req_id in req_ids:
            self._tokens.pop(req_id, None)

    # ---- the batch -----------------------------------------------------------------

    def update_state(self, requests: list[ScheduledRequest]) -> None:
        """Tells every processor how the batch changed: `requests` are the step's sampled
        ones, in logits row order. Every processor is told, even after one raised (each
        keeps the same view of the batch); LogitsProcessorError names the first that did."""
        batch_update = self._batch_update(requests)
        error: LogitsProcessorError | None = None
        for name, processor in self.processors:
            try:
                processor.update_state(batch_update)
            except Exception as raised:
                error = error or _error(name, "update_state", raised)
        if error is not None:
            raise error

    def _batch_update(self, requests: list[ScheduledRequest]) -> BatchUpdate | None:
        """removed, added, moved (applied in that order) taking the last step's rows to
        this step's order; None when it is the same.

        A new request takes a row no request held in the last step (above the last batch,
        below max_num_seqs) while there is one: then no index is both removed and added,
        and a processor that applies the added before the removed (as vLLM's docs' example
        does) cannot drop it. Only when the batch turns over more rows than are free does
        one take a removed request's row, which then leaves `removed`, as in vLLM (whose
        additions fill the removed rows first). Moves then put every request in its row."""
        new_rows = [scheduled.req_id for scheduled in requests]
        old_rows = self._rows
        if new_rows == old_rows:
            return None
        size = len(new_rows)
        staying = set(new_rows)
        removed = [index for index, req_id in enumerate(old_rows) if req_id not in staying]
        capacity = max(self._max_rows, len(old_rows), size)
        slots: list[int | None] = [req_id if req_id in staying else None for req_id in old_rows]
        slots.extend([None] * (capacity - len(slots)))
        where = {req_id: index for index, req_id in enumerate(slots) if req_id is not None}
        joining = [(row, scheduled) for row, scheduled in enumerate(requests) if scheduled.req_id not in where]
        never_held = [index for index in range(len(old_rows), capacity)]
        taken: set[int] = set()
        for row, scheduled in joining:  # first, new requests whose own row is such a row
            if row >= len(old_rows):
                slots[row] = scheduled.req_id
                where[scheduled.req_id] = row
                taken.add(row)
        free_rows = iter([index for index in never_held if index not in taken]
                         + sorted(removed))  # the removed last: taking one drops it from `removed`
        added = []
        for _, scheduled in joining:
            if scheduled.req_id not in where:
                index = next(free_rows)
                if index < len(old_rows):
                    removed.remove(index)
                slots[index] = scheduled.req_id
                where[scheduled.req_id] = index
            tokens = self._tokens[scheduled.req_id]
            added.append((where[scheduled.req_id], scheduled.sampling_params, tokens.prompt, tokens.output))
        moved = []
        for row, req_id in enumerate(new_rows):
            current = where[req_id]
            if current == row:
                continue
            other = slots[row]
            if other is None:
                moved.append((current, row, MoveDirectionality.UNIDIRECTIONAL))
                slots[current] = None
            else:
                moved.append((current, row, MoveDirectionality.SWAP))
                slots[current] = other
                where[other] = current
            slots[row] = req_id
            where[req_id] = row
        assert all(req_id is None for req_id in slots[size:]), "every request ends in a row below the batch size"
        self._rows = new_rows
        return BatchUpdate(batch_size=size, removed=removed, added=added, moved=moved)

    # ---- applying ------------------------------------------------------------------

    def apply_non_argmax_invariant(self, logits: torch.Tensor) -> torch.Tensor:
        return _apply(self.non_argmax_invariant, logits)

    def apply_argmax_invariant(self, logits: torch.Tensor) -> torch.Tensor:
        return _apply(self.argmax_invariant, logits)


def _apply(processors: list[tuple[str, LogitsProcessor]], logits: torch.Tensor) -> torch.Tensor:
    for name, processor in processors:
        try:
            result = processor.apply(logits)
        except Exception as raised:
            raise _error(name, "apply", raised) from raised
        if result is not logits:
            _check_result(name, result, logits)
            try:
                logits.copy_(result)  # the sampler's later stages hold `logits`
            except Exception as raised:  # a device the logits' cannot read from, say
                raise _error(name, "apply (copying its result into the logits)", raised) from raised
    return logits


def _check_result(name: str, result: object, logits: torch.Tensor) -> None:
    """`apply`'s result must be a dense floating-point tensor of the logits' shape (any float
    dtype, any device with data): copied into the logits, anything else (a sparse, meta,
    quantized, complex or integer tensor) would fail the copy or lose its meaning."""
    if not isinstance(result, torch.Tensor):
        what = type(result).__name__
    elif result.shape != logits.shape:
        what = f"shape {tuple(result.shape)}"
    elif result.layout != torch.strided or result.is_quantized or result.is_meta or not result.is_floating_point():
        what = f"a {result.layout} tensor of dtype {result.dtype} on {result.device}"
    else:
        return
    raise LogitsProcessorError(f"The logits processor {name}'s apply returned {what}, not a dense floating-point "
                               f"tensor of the logits' shape {tuple(logits.shape)} (change the logits in place "
                               f"and return them, or return new ones).")


def _error(name: str, method: str, raised: Exception) -> LogitsProcessorError:
    error = LogitsProcessorError(f"The logits processor {name} raised in {method}: {type(raised).__name__}: "
                                 f"{raised}. The requests of the step were ended; the engine serves on.")
    error.__cause__ = raised
    return error

"""Custom logits processors: vLLM v1's batch-level interface, under vLLM's names.

A processor written for vLLM (`vllm.v1.sample.logits_processor`) ports by changing its
import to this module. The engine argument `logits_processors` names the classes; the
worker that samples builds one instance of each at start (`__init__(vllm_config, device,
is_pin_memory)`, `vllm_config` being raylm's `EngineConfig`) and, every step:

1. `update_state(batch_update)`: the changes to the batch since the last step (None if
   none). A request's index is its row in the logits of the steps that follow, until a
   later update removes or moves it. Apply `removed`, then `added`, then `moved`, in
   that order (`process_dict_updates` does so for a dict keyed by index).
2. `apply(logits)`: the [batch_size, vocab] fp32 logits, to change in place or replace;
   the returned tensor is sampled from.

Where `apply` runs (vLLM v1's order): processors that may change the argmax
(`is_argmax_invariant()` False) after allowed_token_ids, bad_words, logit_bias and
min_tokens, before the penalties; argmax-invariant ones only for batches with a row that
samples randomly, after temperature and min_p, before top-k and top-p (greedy rows are
drawn before them). Per-request settings travel in `SamplingParams.extra_args` (the
server's `vllm_xargs`), which `validate_params` may refuse when the request arrives.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum, auto
from functools import partial
from typing import TYPE_CHECKING, TypeVar, Union

import torch

from raylm.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from raylm.engine.config import EngineConfig


class MoveDirectionality(Enum):
    # A one-way move of the request at index a to index b (b held none, or one dropped).
    UNIDIRECTIONAL = auto()
    # The requests at a and b trade places.
    SWAP = auto()


# The index of a request that left the batch.
RemovedRequest = int
# (index, params, prompt token ids, output token ids) of a request that joined the batch.
# The output list is the worker's own running list: it holds every output token so far
# at each later step (read it, do not change it).
AddedRequest = tuple[int, SamplingParams, Union[list[int], None], list[int]]
# (index a, index b, directionality).
MovedRequest = tuple[int, int, MoveDirectionality]


@dataclass(frozen=True)
class BatchUpdate:
    """How the batch changed since the last step: apply removed, then added, then moved.
    An added or moved request may take an index another one held."""

    batch_size: int  # requests in the batch now: indices 0 .. batch_size - 1
    removed: Sequence[RemovedRequest]
    added: Sequence[AddedRequest]
    moved: Sequence[MovedRequest]


class LogitsProcessor(ABC):
    """A batch-level logits processor (vLLM v1's `LogitsProcessor`)."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        """Raises ValueError for parameters (`extra_args`) this processor refuses; called
        when a request is added, so that it fails alone, before it runs."""
        return None

    @abstractmethod
    def __init__(self, vllm_config: EngineConfig, device: torch.device, is_pin_memory: bool) -> None:
        raise NotImplementedError

    @abstractmethod
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The batch's logits after this processor (may be `logits`, changed in place)."""
        raise NotImplementedError

    @abstractmethod
    def is_argmax_invariant(self) -> bool:
        """True if the processor never changes a row's argmax: it is then skipped for
        batches that only decode greedily."""
        raise NotImplementedError

    @abstractmethod
    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Called before each step's `apply`; `batch_update` is None when the batch did not
        change (the output token lists still grew)."""
        raise NotImplementedError


# vLLM's per-request logits processor: (output_ids, logits_row) -> logits_row, or
# (prompt_ids, output_ids, logits_row) -> logits_row.
RequestLogitsProcessor = Union[Callable[[list[int], torch.Tensor], torch.Tensor],
                               Callable[[list[int], list[int], torch.Tensor], torch.Tensor]]

_State = TypeVar("_State")


def process_dict_updates(req_info: dict[int, _State], batch_update: BatchUpdate | None,
                         new_state: Callable[[SamplingParams, Union[list[int], None], list[int]], _State | None]
                         ) -> bool:
    """Applies `batch_update` to a dict of per-request state keyed by batch index (vLLM's
    helper): `new_state(params, prompt_ids, output_ids)` makes an added request's state,
    None for a request the processor leaves alone. Returns whether anything changed."""
    if not batch_update:
        return False
    updated = False
    for index in batch_update.removed:
        updated |= req_info.pop(index, None) is not None
    for index, params, prompt_ids, output_ids in batch_update.added:
        state = new_state(params, prompt_ids, output_ids)
        if state is not None:
            req_info[index] = state
            updated = True
        else:
            updated |= req_info.pop(index, None) is not None
    for a, b, direction in batch_update.moved:
        a_state = req_info.pop(a, None)
        b_state = req_info.pop(b, None)
        if a_state is not None:
            req_info[b] = a_state
            updated = True
        if direction == MoveDirectionality.SWAP and b_state is not None:
            req_info[a] = b_state
            updated = True
    return updated


class AdapterLogitsProcessor(LogitsProcessor):
    """Runs a per-request function on each row of the requests that ask for it (vLLM's
    adapter). Subclass it, implement `is_argmax_invariant` and `new_req_logits_processor`;
    a subclass's `__init__` must call `super().__init__`."""

    def __init__(self, vllm_config: EngineConfig, device: torch.device, is_pin_memory: bool) -> None:
        # Batch index -> the request's function with its token lists bound (the output
        # list is the running one, so the function always sees the tokens so far).
        self.req_info: dict[int, partial[torch.Tensor]] = {}

    @abstractmethod
    def new_req_logits_processor(self, params: SamplingParams) -> RequestLogitsProcessor | None:
        """The function for a request with these parameters, or None to leave it alone."""
        raise NotImplementedError

    def _new_state(self, params: SamplingParams, prompt_ids: list[int] | None,
                   output_ids: list[int]) -> partial[torch.Tensor] | None:
        request_processor = self.new_req_logits_processor(params)
        if request_processor is None:
            return None
        takes_prompt = len(inspect.signature(request_processor).parameters) == 3
        return partial(request_processor, *([prompt_ids, output_ids] if takes_prompt else [output_ids]))

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.req_info, batch_update, self._new_state)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, request_processor in self.req_info.items():
            row = logits[index]
            new_row = request_processor(row)
            if new_row is not row:
                logits[index] = new_row
        return logits


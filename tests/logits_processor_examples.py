"""Custom logits processors for the tests, written as vLLM's docs write them (only the
import changes): `DummyLogitsProcessor` keeps a request's `extra_args["target_token"]` alone
(every other token at -inf), so every token such a request draws is that token.
Importable by name ("logits_processor_examples:DummyLogitsProcessor") where tests/ is on
the path (the HTTP tests' server process)."""

from __future__ import annotations

import torch

from raylm.engine.logits_processor import (AdapterLogitsProcessor, BatchUpdate, LogitsProcessor,
                                           MoveDirectionality)
from raylm.engine.sampling_params import SamplingParams


class DummyLogitsProcessor(LogitsProcessor):
    """vLLM's docs' example: masks every token but `target_token` in the requests that set it.
    One line added: an added request without a target clears its index, which a request
    removed in the same update may have held (vLLM gives removed indices to added requests
    first; raylm does only when the batch has no other free row)."""

    target_key = "target_token"  # the extra_args key read

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        self.req_info: dict[int, int] = {}

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        target = (sampling_params.extra_args or {}).get(cls.target_key)
        if target is not None and not (isinstance(target, int) and target >= 0):
            raise ValueError(f"{cls.target_key} must be a non-negative integer, got {target!r}")

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if not batch_update:
            return
        for index, params, _, _ in batch_update.added:
            if params.extra_args and (target_token := params.extra_args.get(self.target_key)) is not None:
                self.req_info[index] = target_token
            else:
                self.req_info.pop(index, None)
        if self.req_info:
            for index in batch_update.removed:
                self.req_info.pop(index, None)
            for adx, bdx, direct in batch_update.moved:
                a_val = self.req_info.pop(adx, None)
                b_val = self.req_info.pop(bdx, None)
                if a_val is not None:
                    self.req_info[bdx] = a_val
                if direct == MoveDirectionality.SWAP and b_val is not None:
                    self.req_info[adx] = b_val

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.req_info:
            return logits
        cols = torch.tensor(list(self.req_info.values()), dtype=torch.long, device=logits.device)
        rows = torch.tensor(list(self.req_info.keys()), dtype=torch.long, device=logits.device)
        values_to_keep = logits[rows, cols].clone()
        logits[rows] = float("-inf")
        logits[rows, cols] = values_to_keep
        return logits


class ArgmaxInvariantDummy(DummyLogitsProcessor):
    """The same masking, of extra_args["late_target"], declared argmax-invariant (wrongly, on
    purpose): the sampler must run it only for batches with a random row, after greedy rows
    took their argmax."""

    target_key = "late_target"
    applied = 0  # calls to apply, in this process

    def is_argmax_invariant(self) -> bool:
        return True

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        type(self).applied += 1
        return super().apply(logits)


class RaisingLogitsProcessor(LogitsProcessor):
    """Raises in apply while a request with extra_args {"explode": true} is in the batch."""

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        self.exploding: set[int] = set()

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if not batch_update:
            return
        for index in batch_update.removed:
            self.exploding.discard(index)
        for index, params, _, _ in batch_update.added:
            self.exploding.discard(index)
            if (params.extra_args or {}).get("explode"):
                self.exploding.add(index)
        for a, b, direction in batch_update.moved:
            a_in, b_in = a in self.exploding, b in self.exploding
            self.exploding -= {a, b}
            if a_in:
                self.exploding.add(b)
            if direction == MoveDirectionality.SWAP and b_in:
                self.exploding.add(a)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.exploding:
            raise KeyError("boom")
        return logits


class CountUpAdapter(AdapterLogitsProcessor):
    """A per-request function through vLLM's adapter: a request with extra_args
    {"count_up": true} draws its last token plus one (modulo the vocabulary), its prompt's
    last at first, so its output counts up only if the function sees each new token."""

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params: SamplingParams):
        if not (params.extra_args or {}).get("count_up"):
            return None

        def count_up(prompt_ids: list[int], output_ids: list[int], row: torch.Tensor) -> torch.Tensor:
            following = ((output_ids or prompt_ids)[-1] + 1) % row.shape[0]
            kept = row[following].clone()
            row.fill_(float("-inf"))
            row[following] = kept
            return row

        return count_up

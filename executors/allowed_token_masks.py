"""Running requests' `allowed_token_ids` kept on the sampling worker's device, as masks.

The sampler masks every token but a request's allowed ones at each of its steps. Building
that from the ids meant copying them to the device every step for every such request (up
to a vocabulary's worth each); here a request's ids become a [V] bool mask on the device
once, the first time one of its rows is sampled after it was admitted, and each step only
stacks the masks of its rows (a device copy) and sends their row indices. A request's mask
is dropped when it finishes or is preempted (rebuilt when it is readmitted), like its
penalty row (executors/penalty_state.py), so what the masks hold is bounded by the running
requests: at most max_num_seqs x V bytes. The scheduler sends a masked request's release at
once, in a step of its own if nothing else is scheduled, so an idle engine holds none.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from raylm.executors.input_staging import to_device


class AllowedTokenMasks:
    """Per running request with allowed_token_ids, its mask on `device`, keyed by req_id."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self._masks: dict[int, torch.Tensor] = {}
        # Masks built since the start: one per request admission (what a test can count).
        self.num_built = 0

    def __len__(self) -> int:
        return len(self._masks)

    def mask_of(self, req_id: int, allowed_token_ids: list[int], vocab_size: int) -> torch.Tensor:
        """The request's [vocab_size] mask (True where allowed; vocab_size: the logits'
        width), built from its ids on first use."""
        mask = self._masks.get(req_id)
        if mask is None:
            mask = torch.zeros(vocab_size, dtype=torch.bool, device=self.device)
            mask[to_device(allowed_token_ids, self.device)] = True
            self._masks[req_id] = mask
            self.num_built += 1
        return mask

    def release(self, req_ids: Iterable[int]) -> None:
        """Drops the masks of requests that finished, were aborted or were preempted."""
        for req_id in req_ids:
            self._masks.pop(req_id, None)

    def clear(self) -> None:
        self._masks.clear()

"""`LoRASlots`: which adapter each of the workers' `max_loras` LoRA slots holds, as the
scheduler assigns them.

A request that runs under an adapter holds a slot from its admission until it ends or is
preempted; every running request of one adapter shares that adapter's slot. So the running
requests never use more distinct adapters than there are slots, and neither does a step. A
waiting request of an adapter is admitted when the adapter is loaded in host memory
(`LoRALoader.is_ready`) and either already has a slot or a slot is free (no running request
uses it: the least recently used of those is taken, its old adapter dropped). Otherwise it
waits, and within the same scheduling pass no later request of any adapter is admitted
either: the slots then empty as their requests end, so the waiting adapter gets one (base
model requests still go ahead, as they take no slot). The step tells the workers which slots
changed adapter (`take_activations`: the adapter with the digest its files must have, in case
a worker must read them again) and each request's slot.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from raylm.engine.lora_loader import LoRALoader
from raylm.engine.lora_request import LoRARequest
from raylm.engine.request import Request

if TYPE_CHECKING:
    from raylm.executors.lora_adapter import AdapterDigest

# An adapter as a slot holds it: the request naming it and the digest of the files read.
SlotAdapter = tuple[LoRARequest, "AdapterDigest"]


class LoRASlots:
    def __init__(self, max_loras: int, loader: LoRALoader) -> None:
        self.max_loras = max_loras
        self.loader = loader
        # What the workers' slots hold (the driver decides; the steps tell the workers).
        self._adapters: list[SlotAdapter | None] = [None] * max_loras
        # Running requests per slot.
        self._users = [0] * max_loras
        self._last_used = [0] * max_loras
        self._clock = itertools.count(1)
        self._request_slots: dict[str, int] = {}
        # Slots given a new adapter since the last step was built.
        self._activations: dict[int, SlotAdapter] = {}
        # Set within a scheduling pass once an adapter request found no slot.
        self._blocked = False

    def in_use(self, lora_int_id: int) -> bool:
        """Whether a running request uses the adapter (it holds a slot)."""
        return any(users and adapter is not None and adapter[0].lora_int_id == lora_int_id
                   for adapter, users in zip(self._adapters, self._users))

    def start_pass(self) -> None:
        """Called before the scheduler looks at the waiting requests."""
        self._blocked = False

    def can_admit(self, request: Request) -> bool:
        """Whether the request may join the running ones as far as LoRA goes."""
        lora_request = request.lora_request
        if lora_request is None:
            return True
        if self._blocked or not self.loader.is_ready(lora_request, request.lora_digest):
            return False
        if self._slot_holding(request) is not None or self._free_slot() is not None:
            return True
        self._blocked = True
        return False

    def acquire(self, request: Request) -> None:
        """Gives an admitted request its adapter's slot (can_admit said yes)."""
        lora_request = request.lora_request
        if lora_request is None:
            return
        slot = self._slot_holding(request)
        if slot is None:
            slot = self._free_slot()
            assert slot is not None, "acquire without can_admit"
            self._adapters[slot] = self._activations[slot] = (lora_request, request.lora_digest)
        self._users[slot] += 1
        self._last_used[slot] = next(self._clock)
        self._request_slots[request.request_id] = slot
        self.loader.touch(lora_request.lora_int_id)

    def release(self, request: Request) -> None:
        """The request ended or was preempted; harmless for requests holding no slot."""
        slot = self._request_slots.pop(request.request_id, None)
        if slot is not None:
            self._users[slot] -= 1

    def slot_of(self, request: Request) -> int:
        """The request's slot, -1 for the base model."""
        return self._request_slots.get(request.request_id, -1)

    def take_activations(self) -> dict[int, SlotAdapter] | None:
        """The slots that changed adapter since the last call (for the next step), or None."""
        if not self._activations:
            return None
        activations, self._activations = self._activations, {}
        return activations

    def forget(self, lora_int_id: int) -> None:
        """The adapter was removed (or a step could not read it into its slot): slots holding
        it that no request uses are emptied, so that an adapter loaded again under this id is
        copied into a slot again."""
        for slot, adapter in enumerate(self._adapters):
            if adapter is not None and adapter[0].lora_int_id == lora_int_id and not self._users[slot]:
                self._adapters[slot] = None

    def _slot_holding(self, request: Request) -> int | None:
        held = (request.lora_request, request.lora_digest)
        return next((slot for slot, adapter in enumerate(self._adapters) if adapter == held), None)

    def _free_slot(self) -> int | None:
        """An empty slot, else the least recently used one no running request uses."""
        free = [slot for slot in range(self.max_loras) if not self._users[slot]]
        if not free:
            return None
        empty = [slot for slot in free if self._adapters[slot] is None]
        return empty[0] if empty else min(free, key=self._last_used.__getitem__)

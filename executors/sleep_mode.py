"""`SleepingWeights`: a model's parameters taken out of device memory while the engine sleeps
(vLLM's sleep mode, `enable_sleep_mode`).

vLLM frees sleeping memory through its own CUDA allocator, which unmaps the pages under
every tensor tagged "weights" and maps fresh ones at wake-up, keeping the addresses. Here
each parameter's storage is shrunk to nothing (`UntypedStorage.resize_(0)`, what FSDP does
to free a sharded parameter) and grown again at wake-up: the parameters, and every view
of them a module keeps (the output-row projections of `parallel/linear.py`), stay the same
Python objects, so nothing that holds them has to be rebuilt. The addresses change, so the
CUDA graphs, which read weights by address, are captured again (`ModelRunner.wake_up`).
Buffers (rotary tables) are small and stay where they are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class _SleepingStorage:
    storage: torch.UntypedStorage
    nbytes: int
    # Level 1: the bytes, in (pinned, on CUDA) host memory; level 2: None (discarded).
    backup: torch.Tensor | None


class SleepingWeights:
    """The parameter storages of some models, freed, with what is needed to restore them."""

    def __init__(self, storages: list[_SleepingStorage]) -> None:
        self._storages = storages

    @classmethod
    def take(cls, models: list[nn.Module], keep_contents: bool) -> "SleepingWeights":
        """Frees every parameter storage of `models` (each storage once: tied weights share
        one), first copying its bytes to host memory if keep_contents (sleep level 1)."""
        seen: set[int] = set()
        storages: list[_SleepingStorage] = []
        for model in models:
            for param in model.parameters():
                storage = param.data.untyped_storage()
                if storage.nbytes() == 0 or storage.data_ptr() in seen:
                    continue
                seen.add(storage.data_ptr())
                backup = None
                if keep_contents:
                    on_cuda = storage.device.type == "cuda"
                    backup = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=on_cuda)
                    backup.copy_(_bytes_of(storage), non_blocking=on_cuda)
                storages.append(_SleepingStorage(storage, storage.nbytes(), backup))
        if storages and storages[0].storage.device.type == "cuda":
            torch.cuda.synchronize(storages[0].storage.device)  # the copies are done before the memory goes
        for entry in storages:
            entry.storage.resize_(0)
        return cls(storages)

    @property
    def nbytes(self) -> int:
        return sum(entry.nbytes for entry in self._storages)

    def restore(self) -> None:
        """Allocates every storage again: its bytes as they were (level 1), or zeros (level 2)."""
        for entry in self._storages:
            entry.storage.resize_(entry.nbytes)
            data = _bytes_of(entry.storage)
            if entry.backup is not None:
                data.copy_(entry.backup, non_blocking=True)
            else:
                data.zero_()
        if self._storages and self._storages[0].storage.device.type == "cuda":
            torch.cuda.synchronize(self._storages[0].storage.device)
        self._storages = []


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over a storage's bytes."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (storage.nbytes(),), (1,))

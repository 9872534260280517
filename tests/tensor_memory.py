"""The peak of tensor memory a block of code allocates, on the CPU (whose allocator keeps no
peak statistic, unlike torch.cuda.max_memory_allocated): a TorchDispatchMode sees every op's
outputs, tracks their storages by weak reference, and records the most bytes alive at once.
Only storages created inside the block count (an op's output that shares an input's storage,
a view or an in-place result, allocated nothing); memory a native op allocates and frees
before it returns is not seen (its outputs are)."""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class PeakTensorBytes(TorchDispatchMode):
    """`with PeakTensorBytes() as memory: ...`, then `memory.peak` (bytes)."""

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        live = self._live
        for key in [key for key, (ref, _) in live.items() if ref.expired()]:
            del live[key]
        # An output sharing an input's storage (a view, an in-place op) allocated nothing.
        inputs = {storage._cdata for storage in map(_storage, tree_leaves((args, kwargs))) if storage is not None}
        for storage in map(_storage, tree_leaves(out)):
            if storage is not None and storage._cdata not in inputs:
                live.setdefault(storage._cdata, (StorageWeakRef(storage), storage.nbytes()))
        self.peak = max(self.peak, sum(nbytes for _, nbytes in live.values()))
        return out


def _storage(leaf) -> torch.UntypedStorage | None:
    """A CPU tensor's storage; None for anything else (oneDNN's packed weights have none)."""
    if not isinstance(leaf, torch.Tensor) or leaf.device.type != "cpu" or leaf.layout != torch.strided \
            or leaf.is_mkldnn:
        return None
    return leaf.untyped_storage()

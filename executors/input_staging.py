"""One staging buffer for a step's integer inputs: filled on the host, sent to the device
in one copy.

On a GPU every `torch.tensor(list, device="cuda")` copies from pageable memory, and
PyTorch waits for the stream to drain before such a copy returns: a step that built its
six or seven input tensors so stalled the host that many times while the previous step's
kernels still ran. Here the step's arrays are written into one pinned host buffer at
fixed, 128-byte aligned offsets (Triton specialises kernels on 16-byte pointer
alignment, so every step must hand over equally aligned pointers), and one non-blocking
copy moves the used bytes into a device buffer of the same layout; the step's tensors are
views of it. Views of a fixed region keep fixed addresses, which is what a captured CUDA
graph reads (`executors/cuda_graphs.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain
from dataclasses import dataclass

import numpy as np
import torch

_ALIGN = 128


@dataclass(frozen=True)
class Field:
    """One array of a layout: `numel` elements of `dtype` at byte `offset`."""

    name: str
    dtype: torch.dtype
    numel: int
    offset: int

    @property
    def nbytes(self) -> int:
        return self.numel * _itemsize(self.dtype)

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


def layout(fields: Sequence[tuple[str, torch.dtype, int]]) -> dict[str, Field]:
    """Consecutive aligned fields (name, dtype, number of elements)."""
    placed: dict[str, Field] = {}
    offset = 0
    for name, dtype, numel in fields:
        placed[name] = Field(name, dtype, numel, offset)
        offset = _aligned(offset + numel * _itemsize(dtype))
    return placed


def layout_bytes(fields: dict[str, Field]) -> int:
    return _aligned(max((f.end for f in fields.values()), default=0))


class InputStaging:
    """A pinned host buffer and a device buffer of `capacity` bytes, grown on demand.

    Use: `host(field)` gives a numpy view to fill, `send(nbytes)` copies the first nbytes
    over, `device(field, shape)` gives the tensor view. A step's `host` views must not be
    written before the previous step's copy has left them: `host` waits for it (by then
    the step's sampled tokens, read back on the host, have long forced it)."""

    def __init__(self, device: torch.device, capacity: int = 1 << 16) -> None:
        self.device = torch.device(device)
        self._pinned = self.device.type == "cuda"
        self._host = torch.empty(0, dtype=torch.uint8)
        self._device = torch.empty(0, dtype=torch.uint8, device=self.device)
        self._host_np = self._host.numpy()
        self._copied: torch.cuda.Event | None = None
        self.reserve(capacity)

    @property
    def capacity(self) -> int:
        return self._host.numel()

    def reserve(self, nbytes: int) -> bool:
        """Makes room for nbytes; True if the buffers were reallocated (earlier views, and
        graphs captured on them, then point at the old device buffer)."""
        if nbytes <= self.capacity:
            return False
        self._wait_for_copy()
        nbytes = _aligned(max(nbytes, 2 * self.capacity))
        self._host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self._pinned)
        self._host_np = self._host.numpy()
        self._device = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return True

    def host(self, field: Field, shape: tuple[int, ...] | None = None) -> np.ndarray:
        """The field's host bytes as a writable numpy array (of `shape`, default 1-D)."""
        self._wait_for_copy()
        array = self._host_np[field.offset:field.end].view(_NUMPY_DTYPES[field.dtype])
        return array if shape is None else array.reshape(shape)

    def send(self, nbytes: int) -> None:
        """Copies the first nbytes to the device (asynchronously on a GPU)."""
        nbytes = _aligned(nbytes)
        if self.device.type == "cuda":
            self._device[:nbytes].copy_(self._host[:nbytes], non_blocking=True)
            if self._copied is None:
                self._copied = torch.cuda.Event()
            self._copied.record()
        else:
            self._device[:nbytes].copy_(self._host[:nbytes])

    def device_view(self, field: Field, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """The field's bytes on the device as a tensor of its dtype (of `shape`, default 1-D)."""
        view = self._device[field.offset:field.end].view(field.dtype)
        return view if shape is None else view.view(shape)

    def release(self) -> None:
        self._wait_for_copy()
        self._host = torch.empty(0, dtype=torch.uint8)
        self._host_np = self._host.numpy()
        self._device = torch.empty(0, dtype=torch.uint8, device=self.device)

    def _wait_for_copy(self) -> None:
        if self._copied is not None:
            self._copied.synchronize()


def fill_block_tables(array: np.ndarray, tables: Sequence[Sequence[int]]) -> None:
    """Writes each table into a row of `array` [rows, width], zero-padded (block 0, which a
    kernel never reads past a sequence's length). One masked store of the concatenated
    tables: a numpy assignment per row cost ~1.4 us, a third of a millisecond at batch 256."""
    if not tables:
        return
    lengths = np.fromiter(map(len, tables), dtype=np.int64, count=len(tables))
    # The mask's true cells, in row-major order, are each row's first len(table) cells.
    filled = np.arange(array.shape[1]) < lengths[:, None]
    array[:len(tables)] = 0
    array[:len(tables)][filled] = np.array(list(chain.from_iterable(tables)), dtype=array.dtype)


def host_tensor(values: Sequence, dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of a host list (of numbers, or of equal-length lists), made through
    numpy: `torch.tensor(list)` converts element by element, several times slower (~30 us
    against ~4 us for 256 ints), and a step makes several such tensors."""
    numpy_dtype = _NUMPY_DTYPES.get(dtype)
    if numpy_dtype is None or not isinstance(values, list):
        return torch.tensor(values, dtype=dtype)
    return torch.from_numpy(np.array(values, dtype=numpy_dtype))


def to_device(data: Sequence, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A small host list (indices, per-row parameters) as a tensor on `device`, without
    stalling the host: on a GPU through pinned memory and a non-blocking copy (from a plain
    list PyTorch would wait for every kernel queued before it, as the module's docstring
    says); PyTorch's pinned-memory cache keeps the buffer until the copy has left it. On
    the CPU, the tensor itself."""
    if device.type == "cpu":
        return torch.tensor(data, dtype=dtype) if dtype is None else host_tensor(data, dtype)
    return torch.tensor(data, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


_NUMPY_DTYPES = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32}

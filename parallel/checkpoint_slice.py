"""A checkpoint tensor that reads from disk only the part a weight loader keeps.

Tensor-parallel weight loaders take the full Hugging Face tensor and cut their shard
with `narrow`; handing them a `CheckpointSlice` instead means each worker reads only its
shard's bytes from the safetensors file (safetensors' own slice reading), not the whole
tensor. Loaders call `read_weight` where they copy.
"""

from __future__ import annotations

from typing import Any

import torch


class CheckpointSlice:
    """A rectangular window onto one tensor of a safetensors file, read on demand."""

    def __init__(self, source: Any, shape: tuple[int, ...], window: tuple[slice, ...] | None = None) -> None:
        # `source` is a safetensors slice handle (safe_open(...).get_slice(name)).
        self._source = source
        self.shape = torch.Size(shape)
        self._window = window if window is not None else tuple(slice(0, n) for n in shape)

    @property
    def dtype_name(self) -> str:
        """The file's dtype of the tensor, as safetensors spells it ("BF16", "F8_E4M3"), read
        from its header."""
        return self._source.get_dtype()

    def dim(self) -> int:
        return len(self.shape)

    def narrow(self, dim: int, start: int, length: int) -> "CheckpointSlice":
        if not 0 <= start <= start + length <= self.shape[dim]:
            raise ValueError(f"cannot take rows {start}:{start + length} of dimension {dim} of a checkpoint tensor "
                             f"of shape {tuple(self.shape)}.")
        window = list(self._window)
        base = window[dim].start
        window[dim] = slice(base + start, base + start + length)
        shape = list(self.shape)
        shape[dim] = length
        return CheckpointSlice(self._source, tuple(shape), tuple(window))

    def __getitem__(self, rows: slice) -> "CheckpointSlice":
        """Rows `start:stop` of the first dimension (the only indexing loaders use)."""
        start, stop, step = rows.indices(self.shape[0])
        if step != 1:
            raise ValueError("checkpoint slices support contiguous row ranges only.")
        return self.narrow(0, start, max(0, stop - start))

    def read(self) -> torch.Tensor:
        if not self.shape:
            return self._source[()]  # a scalar (an fp8 checkpoint's k_scale): [:] is an IndexError
        return self._source[self._window]


def read_weight(weight: torch.Tensor | CheckpointSlice) -> torch.Tensor:
    """The tensor behind a weight handed to a loader: read now if it is a checkpoint slice."""
    return weight.read() if isinstance(weight, CheckpointSlice) else weight

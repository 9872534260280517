"""`ShmCommunicator`: tensor-parallel collectives through shared memory, for CPU ranks that
share a machine (`kernels/csrc/shm_comm.cpp` holds the protocol).

gloo carries each collective over TCP loopback; on a CPU a decode step makes several per
layer, and on a machine with few cores each one waits for the kernel to wake a peer: with
two ranks on the project's 2-core machine the collectives took most of a decode step. Here
every rank maps one segment of /dev/shm; a collective is a copy into the rank's own slot, a
published counter, and reads of the peers' slots, with no system call when the peers are
running. Tensors larger than a slot go through in slot-sized pieces.

Made by `create` at start-up, when every rank of the group runs on this machine and the
native library builds; otherwise the group stays on gloo. For comparisons, "shm_comm" in
RAYLM_TEST_DISABLE_KERNELS (engine/envs.py) keeps gloo.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from raylm.engine import envs
from raylm.kernels.native_build import load_native_library

logger = logging.getLogger(__name__)

# Per rank and per set of slots (two sets): a decode step's hidden states (64 x 4096 fp32)
# fit in one piece, a prefill's go in a few.
DEFAULT_SLOT_BYTES = 1 << 20
_SHM_DIR = Path("/dev/shm")
_DTYPES_REDUCED_NATIVELY = (torch.float32, torch.bfloat16)


def machine_id() -> str:
    """Names this machine (not the Ray node: two Ray nodes on one machine share /dev/shm)."""
    for path in ("/etc/machine-id", "/proc/sys/kernel/random/boot_id"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text:
            return f"{socket.gethostname()}/{text}"
    return socket.gethostname()


class ShmCommunicator:
    def __init__(self, segment: torch.Tensor, rank: int, world_size: int, slot_bytes: int, timeout_s: float) -> None:
        self.segment = segment
        self.rank = rank
        self.world_size = world_size
        self.slot_bytes = slot_bytes
        self.timeout_s = timeout_s
        self._header_bytes = torch.ops.raylm.shm_header_bytes()
        self._seq = 0

    # ---------------------------------------------------------------- set-up
    @classmethod
    def create(cls, store: dist.Store, rank: int, world_size: int, timeout_s: float,
               slot_bytes: int = DEFAULT_SLOT_BYTES) -> "ShmCommunicator | None":
        """Collective over the ranks of `store`: a communicator on every rank, or None on
        every rank (ranks on several machines, no /dev/shm, no native library, or
        "shm_comm" in RAYLM_TEST_DISABLE_KERNELS)."""
        usable = (not envs.kernel_switched_off("shm_comm") and _SHM_DIR.is_dir()
                  and load_native_library("shm_comm") is not None)
        store.set(f"raylm/shm/machine/{rank}", machine_id() if usable else f"unusable/{rank}")
        keys = [f"raylm/shm/machine/{r}" for r in range(world_size)]
        store.wait(keys, timedelta(seconds=timeout_s))
        machines = {store.get(key).decode() for key in keys}
        if len(machines) != 1 or next(iter(machines)).startswith("unusable/"):
            if rank == 0:
                logger.info("Tensor-parallel collectives use gloo: the %d ranks are not all on one machine with "
                            "shared memory and the native library.", world_size)
            return None
        header = torch.ops.raylm.shm_header_bytes()
        size = header + 2 * world_size * slot_bytes
        if rank == 0:
            path = _SHM_DIR / f"raylm-tp-{uuid.uuid4().hex}"
            with open(path, "wb") as f:
                f.truncate(size)  # zero-filled: every arrival counter starts at 0
            store.set("raylm/shm/path", str(path))
        path = Path(store.get("raylm/shm/path").decode())
        segment = torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)
        store.set(f"raylm/shm/mapped/{rank}", "1")
        store.wait([f"raylm/shm/mapped/{r}" for r in range(world_size)], timedelta(seconds=timeout_s))
        if rank == 0:
            # Every rank has it mapped: the name is no longer needed, and nothing is left in
            # /dev/shm however the processes end.
            path.unlink(missing_ok=True)
            logger.info("Tensor-parallel collectives go through shared memory (%d ranks, %d KiB slots).",
                        world_size, slot_bytes // 1024)
        return cls(segment, rank, world_size, slot_bytes, timeout_s)

    # ----------------------------------------------------------- collectives
    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sums `tensor` over ranks in place (bit-identical on every rank); returns it."""
        if tensor.dtype not in _DTYPES_REDUCED_NATIVELY:
            for part, parts in self._exchange(tensor):
                torch.sum(parts, dim=0, out=part)
            return tensor
        work = tensor if tensor.is_contiguous() else tensor.contiguous()
        flat = work.view(-1)
        step = self.slot_bytes // work.element_size()
        for start in range(0, max(flat.numel(), 1), step):
            torch.ops.raylm.shm_all_reduce(flat[start:start + step], self.segment, self.rank, self.world_size,
                                           self._next_seq(), self.slot_bytes, self.timeout_s)
        if work is not tensor:
            tensor.copy_(work)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's tensor concatenated along `dim`, in rank order, on every rank."""
        return torch.cat(self._gather_parts(tensor, keep=True), dim=dim)

    def gather(self, tensor: torch.Tensor, dst: int = 0, dim: int = -1) -> torch.Tensor | None:
        """Every rank's tensor concatenated along `dim` on rank `dst`; None elsewhere."""
        parts = self._gather_parts(tensor, keep=self.rank == dst)
        return torch.cat(parts, dim=dim) if self.rank == dst else None

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank `src`'s tensor copied into `tensor` on every rank; returns it."""
        for part, parts in self._exchange(tensor, publish=self.rank == src):
            if self.rank != src:
                part.copy_(parts[src])
        return tensor

    # -------------------------------------------------------------- plumbing
    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _gather_parts(self, tensor: torch.Tensor, keep: bool) -> list[torch.Tensor]:
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)] if keep else []
        flat_parts = [p.view(-1) for p in parts]
        offset = 0
        for piece, slots in self._exchange(tensor, write_back=False):
            for flat, slot in zip(flat_parts, slots):
                flat[offset:offset + piece.numel()].copy_(slot)
            offset += piece.numel()
        return parts

    def _exchange(self, tensor: torch.Tensor, publish: bool = True, write_back: bool = True):
        """Yields, piece by piece of the flattened tensor, the piece and a [world_size,
        piece] view of every rank's copy of it in shared memory (valid until the next
        piece). Ranks that do not `publish` take part with an empty piece. Changes the
        caller makes to a piece reach `tensor` (when it is not contiguous, at the end)."""
        work = tensor if tensor.is_contiguous() else tensor.contiguous()
        flat = work.view(-1)
        step = self.slot_bytes // work.element_size()
        empty = flat[:0]
        for start in range(0, max(flat.numel(), 1), step):
            piece = flat[start:start + step]
            seq = self._next_seq()
            torch.ops.raylm.shm_exchange(piece if publish else empty, self.segment, self.rank, self.world_size, seq,
                                         self.slot_bytes, self.timeout_s)
            yield piece, self._slots(seq, work.dtype, piece.numel())
        if write_back and work is not tensor:
            tensor.copy_(work)

    def _slots(self, seq: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        first = self._header_bytes + (seq & 1) * self.world_size * self.slot_bytes
        region = self.segment[first:first + self.world_size * self.slot_bytes]
        return region.view(self.world_size, self.slot_bytes).view(dtype)[:, :numel]

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

The segment's name travels through the rendezvous store, which anyone who reaches its port
can read and write, so nothing read from the store is trusted: rank 0 creates the segment
itself (exclusively, mode 0600, never following a link) and deletes its own name whatever
happens; the other ranks map only a name of the form rank 0 makes, in /dev/shm, a regular
file of this user with no access for anyone else and of the expected size.
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import secrets
import stat
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from raylm.engine import envs
from raylm.kernels.native_build import load_native_library
from raylm.parallel.machine_layout import MachineLayout

logger = logging.getLogger(__name__)

# Per rank and per set of slots (two sets): a decode step's hidden states (64 x 4096 fp32)
# fit in one piece, a prefill's go in a few.
DEFAULT_SLOT_BYTES = 1 << 20
_SHM_DIR = Path("/dev/shm")
SEGMENT_PREFIX = "raylm-tp-"
# The only names a rank other than 0 maps: the prefix and 32 hex digits of randomness.
_SEGMENT_NAME = re.compile(re.escape(SEGMENT_PREFIX) + r"[0-9a-f]{32}")
_NAME_KEY = "raylm/shm/name"
_MAPPED_KEY = "raylm/shm/mapped/{rank}"
_MAPPED, _FAILED = "mapped", "failed"
_DTYPES_REDUCED_NATIVELY = (torch.float32, torch.bfloat16)


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
    @staticmethod
    def available() -> bool:
        """Whether this process can take part: "shm_comm" is not in RAYLM_TEST_DISABLE_KERNELS,
        /dev/shm exists and the native library builds. Goes into the machine layout every rank sees."""
        return (not envs.kernel_switched_off("shm_comm") and _SHM_DIR.is_dir()
                and load_native_library("shm_comm") is not None)

    @classmethod
    def create(cls, store: dist.Store, layout: MachineLayout, rank: int, timeout_s: float,
               slot_bytes: int = DEFAULT_SLOT_BYTES) -> "ShmCommunicator | None":
        """Collective over the ranks of `store`: a communicator on every rank, or None on
        every rank (ranks on several machines, or one that cannot use shared memory:
        `layout` says, and every rank holds the same). Raises, on the rank that finds
        it, if the segment named in the store is not one rank 0 made."""
        world_size = len(layout.machines)
        if not layout.one_machine_with_shared_memory:
            if rank == 0:
                logger.info("Tensor-parallel collectives use gloo: the %d ranks are not all on one machine with "
                            "shared memory and the native library.", world_size)
            return None
        size = torch.ops.raylm.shm_header_bytes() + 2 * world_size * slot_bytes
        if rank == 0:
            segment = _create_segment_for_peers(store, world_size, size, timeout_s)
            logger.info("Tensor-parallel collectives go through shared memory (%d ranks, %d KiB slots).",
                        world_size, slot_bytes // 1024)
        else:
            try:
                segment = _map_peer_segment(store, size, timeout_s)
            except BaseException:
                # Rank 0 stops waiting and deletes the segment now rather than at its timeout.
                try:
                    store.set(_MAPPED_KEY.format(rank=rank), _FAILED)
                except Exception:  # noqa: BLE001 - the store itself failing: rank 0 times out instead
                    pass
                raise
            store.set(_MAPPED_KEY.format(rank=rank), _MAPPED)
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


# ------------------------------------------------------------------ the segment
def _create_segment_for_peers(store: dist.Store, world_size: int, size: int, timeout_s: float) -> torch.Tensor:
    """Rank 0: creates and maps a fresh segment, names it in the store, waits until every
    other rank has mapped it (or given up) and deletes the name: once mapped, the memory
    lives as long as its mappings, and nothing is left in /dev/shm however the processes
    end. Raises if a rank failed to map it or did not answer within timeout_s."""
    path = _SHM_DIR / f"{SEGMENT_PREFIX}{secrets.token_hex(16)}"
    # O_EXCL: a name that exists (made by anyone) is an error, not something to reuse;
    # O_NOFOLLOW: never through a link; 0600 (fchmod: whatever the umask): this user only.
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        try:
            os.fchmod(fd, 0o600)
            os.ftruncate(fd, size)  # zero-filled: every arrival counter starts at 0
            segment = _map(fd, size)
        finally:
            os.close(fd)
        store.set(_NAME_KEY, path.name)
        keys = [_MAPPED_KEY.format(rank=r) for r in range(1, world_size)]
        try:
            store.wait(keys, timedelta(seconds=timeout_s))
        except Exception as e:
            missing = [r for r in range(1, world_size) if not store.check([_MAPPED_KEY.format(rank=r)])]
            raise RuntimeError(f"Tensor-parallel rank(s) {missing} did not map the shared-memory segment within "
                               f"{timeout_s:g} s.") from e
        failed = [r for r, key in zip(range(1, world_size), keys) if store.get(key).decode() != _MAPPED]
        if failed:
            raise RuntimeError(f"Tensor-parallel rank(s) {failed} could not map the shared-memory segment "
                               "(their error says why).")
        return segment
    finally:
        path.unlink(missing_ok=True)


def _map_peer_segment(store: dist.Store, size: int, timeout_s: float) -> torch.Tensor:
    """Ranks other than 0: maps the segment rank 0 named in the store, after checking that
    it is one rank 0 can have made: a name of ours in /dev/shm, not a link, a regular file
    of this user that no one else may access, of the expected size."""
    store.wait([_NAME_KEY], timedelta(seconds=timeout_s))
    name = store.get(_NAME_KEY).decode(errors="replace")
    if not _SEGMENT_NAME.fullmatch(name):
        raise RuntimeError(f"Refusing the shared-memory segment {name!r} from the rendezvous store: rank 0 names "
                           f"it {SEGMENT_PREFIX}<32 hex digits> (in {_SHM_DIR}); the store was written by "
                           "something else.")
    path = _SHM_DIR / name
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:  # ELOOP for a link
        raise RuntimeError(f"Refusing the shared-memory segment {path}: it cannot be opened as a file without "
                           f"following links ({e.strerror}).") from e
    try:
        info = os.fstat(fd)
        problems = []
        if not stat.S_ISREG(info.st_mode):
            problems.append("not a regular file")
        if info.st_uid != os.geteuid():
            problems.append(f"owned by uid {info.st_uid}, not {os.geteuid()}")
        if info.st_mode & 0o077:
            problems.append(f"mode {stat.S_IMODE(info.st_mode):04o}, not 0600")
        if info.st_size != size:
            problems.append(f"{info.st_size} bytes, not {size}")
        if problems:
            raise RuntimeError(f"Refusing the shared-memory segment {path}: {', '.join(problems)}; rank 0 did not "
                               "make it.")
        return _map(fd, size)
    finally:
        os.close(fd)


def _map(fd: int, size: int) -> torch.Tensor:
    """`size` bytes of `fd` mapped shared, as a uint8 tensor that keeps the mapping alive."""
    return torch.frombuffer(mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE),
                            dtype=torch.uint8)

"""Shared-memory collectives between CPU ranks of one machine (`ShmCommunicator`), in real
processes, against arithmetic on the inputs every rank is known to hold."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from raylm.parallel.shm_communicator import ShmCommunicator

# Small slots, so that the tests' tensors also go through in several pieces.
SLOT_BYTES = 4096


def rank_tensor(rank: int, shape: tuple[int, ...], dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * salt + rank)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    return torch.randint(-1000, 1000, shape, generator=gen, dtype=dtype)


CASES = [  # (name, shape, dtype): fp32 and bf16 reduce natively, others through torch.sum
    ("fp32-one-piece", (3, 40), torch.float32),
    ("fp32-many-pieces", (64, 300), torch.float32),
    ("bf16-many-pieces", (33, 257), torch.bfloat16),
    ("int64", (5, 1000), torch.int64),
    ("empty", (0, 8), torch.float32),
]


def _store(tmp: str, world_size: int) -> dist.Store:
    return dist.FileStore(os.path.join(tmp, "store"), world_size)


def _collectives(rank: int, world_size: int, tmp: str) -> None:
    torch.set_num_threads(1)
    comm = ShmCommunicator.create(_store(tmp, world_size), rank, world_size, timeout_s=60, slot_bytes=SLOT_BYTES)
    assert comm is not None
    results = {}
    for salt, (name, shape, dtype) in enumerate(CASES):
        x = rank_tensor(rank, shape, dtype, salt)
        results[f"all_reduce/{name}"] = comm.all_reduce(x).clone()
        results[f"all_gather/{name}"] = comm.all_gather(rank_tensor(rank, shape, dtype, salt), dim=-1)
        results[f"gather/{name}"] = comm.gather(rank_tensor(rank, shape, dtype, salt), dst=1, dim=0)
        mine = rank_tensor(rank, shape, dtype, salt)
        results[f"broadcast/{name}"] = comm.broadcast(mine, src=world_size - 1).clone()
    # A non-contiguous tensor is reduced in place all the same.
    base = rank_tensor(rank, (16, 32), torch.float32, 99)
    view = base.t()
    comm.all_reduce(view)
    results["all_reduce/transposed"] = base
    torch.save(results, os.path.join(tmp, f"rank{rank}.pt"))


@pytest.mark.parametrize("world_size", [2, 3])
def test_collectives_match_arithmetic_on_every_rank(tmp_path, world_size):
    mp.spawn(_collectives, args=(world_size, str(tmp_path)), nprocs=world_size, join=True)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world_size)]
    for salt, (name, shape, dtype) in enumerate(CASES):
        inputs = [rank_tensor(r, shape, dtype, salt) for r in range(world_size)]
        # fp32 sums of the exact inputs, rounded once: what the kernel promises.
        expected_sum = torch.stack([x.double() for x in inputs]).sum(0).to(dtype)
        for rank, got in enumerate(results):
            tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {}
            torch.testing.assert_close(got[f"all_reduce/{name}"], expected_sum, **tol,
                                       msg=f"all_reduce {name} on rank {rank}")
            torch.testing.assert_close(got[f"all_gather/{name}"], torch.cat(inputs, dim=-1), rtol=0, atol=0)
            torch.testing.assert_close(got[f"broadcast/{name}"], inputs[-1], rtol=0, atol=0)
            gathered = got[f"gather/{name}"]
            if rank == 1:
                torch.testing.assert_close(gathered, torch.cat(inputs, dim=0), rtol=0, atol=0)
            else:
                assert gathered is None
        # Every rank holds the same bits: replicated activations must not drift apart.
        for got in results[1:]:
            assert torch.equal(got[f"all_reduce/{name}"], results[0][f"all_reduce/{name}"])
    expected = torch.stack([rank_tensor(r, (16, 32), torch.float32, 99).double() for r in range(world_size)]).sum(0)
    for got in results:
        torch.testing.assert_close(got["all_reduce/transposed"], expected.float())


def _segment_names() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("raylm-tp-*")}


def _create_and_report(rank: int, world_size: int, tmp: str) -> None:
    comm = ShmCommunicator.create(_store(tmp, world_size), rank, world_size, timeout_s=60, slot_bytes=SLOT_BYTES)
    Path(tmp, f"made{rank}").write_text("yes" if comm is not None else "no")


def test_the_segment_leaves_no_file_in_dev_shm(tmp_path):
    before = _segment_names()
    mp.spawn(_create_and_report, args=(2, str(tmp_path)), nprocs=2, join=True)
    assert [(tmp_path / f"made{r}").read_text() for r in range(2)] == ["yes", "yes"]
    assert _segment_names() - before == set()


def _create_with_env(rank: int, world_size: int, tmp: str) -> None:
    os.environ["RAYLM_TEST_DISABLE_KERNELS"] = "shm_comm" if rank == 1 else ""
    _create_and_report(rank, world_size, tmp)


def test_one_rank_without_it_keeps_every_rank_on_gloo(tmp_path):
    mp.spawn(_create_with_env, args=(2, str(tmp_path)), nprocs=2, join=True)
    assert [(tmp_path / f"made{r}").read_text() for r in range(2)] == ["no", "no"]


def _absent_peer(rank: int, world_size: int, tmp: str) -> None:
    comm = ShmCommunicator.create(_store(tmp, world_size), rank, world_size, timeout_s=1.0, slot_bytes=SLOT_BYTES)
    if rank == 1:
        return  # never takes part in the collective
    start = time.monotonic()
    try:
        comm.all_reduce(torch.ones(4))
    except RuntimeError as e:
        Path(tmp, "error").write_text(f"{time.monotonic() - start:.2f}\n{e}")


def test_a_rank_that_never_arrives_is_named_after_the_timeout(tmp_path):
    mp.spawn(_absent_peer, args=(2, str(tmp_path)), nprocs=2, join=True)
    elapsed, message = (tmp_path / "error").read_text().split("\n", 1)
    assert "rank(s) [1] did not arrive within 1 s" in message
    assert 0.9 <= float(elapsed) < 10

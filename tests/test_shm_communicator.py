"""Shared-memory collectives between CPU ranks of one machine (`ShmCommunicator`), in real
processes, against arithmetic on the inputs every rank is known to hold; and its set-up
against a rendezvous store that someone else writes into (a real TCPStore client playing
the attacker)."""

from __future__ import annotations

import os
import secrets
import stat
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from raylm.parallel.machine_layout import MachineLayout, exchange_machine_layout
from raylm.parallel.shm_communicator import SEGMENT_PREFIX, ShmCommunicator

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


def _create(store: dist.Store, rank: int, world_size: int, timeout_s: float) -> ShmCommunicator | None:
    """What a worker does: the machine layout, then the communicator."""
    layout = exchange_machine_layout(store, rank, world_size, timeout_s, shared_memory=ShmCommunicator.available())
    return ShmCommunicator.create(store, layout, rank, timeout_s=timeout_s, slot_bytes=SLOT_BYTES)


def _collectives(rank: int, world_size: int, tmp: str) -> None:
    torch.set_num_threads(1)
    comm = _create(_store(tmp, world_size), rank, world_size, timeout_s=60)
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
    return {p.name for p in Path("/dev/shm").glob(f"{SEGMENT_PREFIX}*")}


def _create_and_report(rank: int, world_size: int, tmp: str) -> None:
    comm = _create(_store(tmp, world_size), rank, world_size, timeout_s=60)
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
    comm = _create(_store(tmp, world_size), rank, world_size, timeout_s=60)
    if rank == 1:
        return  # never takes part in the collective
    comm.timeout_s = 1.0  # the collectives' (set-up may take longer on a loaded machine)
    start, start_cpu = time.monotonic(), time.process_time()
    try:
        comm.all_reduce(torch.ones(4))
    except RuntimeError as e:
        Path(tmp, "error").write_text(f"{time.monotonic() - start:.2f} {time.process_time() - start_cpu:.3f}\n{e}")


def test_a_rank_that_never_arrives_is_named_after_the_timeout(tmp_path):
    mp.spawn(_absent_peer, args=(2, str(tmp_path)), nprocs=2, join=True)
    figures, message = (tmp_path / "error").read_text().split("\n", 1)
    elapsed, cpu_seconds = map(float, figures.split())
    assert "rank(s) [1] did not arrive within 1 s" in message
    assert 0.9 <= elapsed < 10
    # The waiting rank sleeps between polls once its peer is late by far more than a step's
    # share takes: it does not spin (or yield) a core away for the whole timeout.
    assert cpu_seconds < 0.1, f"the waiting rank used {cpu_seconds} s of CPU in {elapsed} s"


# ------------------------------------------------------------ a hostile rendezvous store
NAME_KEY = "raylm/shm/name"
ONE_MACHINE = MachineLayout(machines=("here", "here"), shared_memory=(True, True))
VICTIM_BYTES = b"precious data, not a segment\n" * 10


def _tcp_store(port: int = 0, is_master: bool = False) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, 2, is_master=is_master, timeout=timedelta(seconds=20),
                         wait_for_workers=False)


def _segment_size() -> int:
    return torch.ops.raylm.shm_header_bytes() + 2 * 2 * SLOT_BYTES


@pytest.fixture
def shm_available():
    if not ShmCommunicator.available():
        pytest.skip("no /dev/shm or no native library here")


@pytest.fixture
def victim(tmp_path) -> Path:
    """A file of this user that no segment may touch."""
    path = tmp_path / "victim.txt"
    path.write_bytes(VICTIM_BYTES)
    return path


def _in_thread(fn, *args):
    """Runs fn in a thread; the returned function joins it and returns its result or raises."""
    outcome = {}

    def run():
        try:
            outcome["value"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            outcome["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    def join():
        thread.join(60)
        assert not thread.is_alive(), "create did not return"
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]

    return join


def test_rank_0_creates_the_segment_for_this_user_only(shm_available):
    server = _tcp_store(is_master=True)
    peer = _tcp_store(server.port)
    before = _segment_names()
    join = _in_thread(ShmCommunicator.create, server, ONE_MACHINE, 0, 20, SLOT_BYTES)
    peer.wait([NAME_KEY], timedelta(seconds=20))
    name = peer.get(NAME_KEY).decode()
    info = os.lstat(Path("/dev/shm", name))
    peer.set("raylm/shm/mapped/1", "mapped")
    assert join() is not None
    assert stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid()
    assert stat.S_IMODE(info.st_mode) == 0o600
    assert _segment_names() - before == set()


def test_rank_0_deletes_its_segment_when_a_peer_never_maps_it(shm_available):
    server = _tcp_store(is_master=True)
    before = _segment_names()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank\(s\) \[1\] did not map the shared-memory segment within 1 s"):
        ShmCommunicator.create(server, ONE_MACHINE, 0, timeout_s=1.0, slot_bytes=SLOT_BYTES)
    assert time.monotonic() - start < 10
    assert _segment_names() - before == set()


def _overwrite_the_name(port: int, victim: str) -> None:
    """The attacker: writes `victim` over the segment's name as fast as it can (its own
    process, so that no lock slows it down) until the test says stop."""
    store = _tcp_store(port)
    while True:
        for _ in range(100):
            store.set(NAME_KEY, victim)
            store.set("raylm/shm/path", victim)  # the key of the first version
        if store.check(["stop"]):
            return


def test_rank_0_neither_maps_nor_deletes_a_path_written_into_the_store(shm_available, victim):
    server = _tcp_store(is_master=True)
    before = _segment_names()
    attacker = mp.get_context("fork").Process(target=_overwrite_the_name, args=(server.port, str(victim)))
    attacker.start()
    try:
        time.sleep(1.0)  # the attacker is writing before rank 0 starts
        join = _in_thread(ShmCommunicator.create, server, ONE_MACHINE, 0, 20, SLOT_BYTES)
        time.sleep(0.5)
        peer = _tcp_store(server.port)
        peer.set("raylm/shm/mapped/1", "mapped")
        comm = join()
    finally:
        _tcp_store(server.port).set("stop", "1")
        attacker.join(20)
    assert victim.exists() and victim.read_bytes() == VICTIM_BYTES
    assert comm is not None and comm.segment.numel() == _segment_size()
    assert _segment_names() - before == set()


def _hostile_names(tmp: Path, victim: Path) -> dict[str, str]:
    """Names an attacker can put in the store, and what each points at."""
    token = secrets.token_hex(16)
    link = Path("/dev/shm", f"{SEGMENT_PREFIX}{token}")
    link.symlink_to(victim)
    shared = Path("/dev/shm", f"{SEGMENT_PREFIX}{secrets.token_hex(16)}")
    shared.write_bytes(bytes(_segment_size()))
    shared.chmod(0o644)
    return {
        "an absolute path": str(victim),
        "a relative path out of /dev/shm": os.path.relpath(victim, "/dev/shm"),
        "a link with our name": link.name,
        "a segment others may read": shared.name,
    }


def test_a_peer_maps_only_a_private_segment_of_this_user_named_as_rank_0_names_it(shm_available, tmp_path,
                                                                                  victim):
    names = _hostile_names(tmp_path, victim)
    try:
        for what, name in names.items():
            server = _tcp_store(is_master=True)  # the attacker answers as rank 0
            server.set(NAME_KEY, name)
            server.set("raylm/shm/path", name if "/" in name else f"/dev/shm/{name}")  # the first version's key
            peer = _tcp_store(server.port)
            with pytest.raises(RuntimeError, match="Refusing the shared-memory segment"):
                ShmCommunicator.create(peer, ONE_MACHINE, 1, timeout_s=5, slot_bytes=SLOT_BYTES)
            assert victim.read_bytes() == VICTIM_BYTES, what
            # Rank 0 hears at once that this rank gave up.
            assert server.get("raylm/shm/mapped/1") == b"failed", what
    finally:
        for name in names.values():
            if "/" not in name:
                Path("/dev/shm", name).unlink(missing_ok=True)

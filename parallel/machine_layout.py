"""Which tensor-parallel ranks share a machine, learnt once at start-up through the
rendezvous store.

A machine, not a Ray node: two Ray nodes on one machine share its cores and its /dev/shm.
The workers use the layout twice: CPU ranks of one machine split its cores among them
(`executors/worker.py`), and when every rank is on one machine their collectives go
through shared memory (`shm_communicator.py`).
"""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

_KEY = "raylm/layout/{rank}"


def machine_id() -> str:
    """Names this machine (the host name and its machine id or boot id)."""
    for path in ("/etc/machine-id", "/proc/sys/kernel/random/boot_id"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text:
            return f"{socket.gethostname()}/{text}"
    return socket.gethostname()


@dataclass(frozen=True)
class MachineLayout:
    """Per rank of the group, in rank order: its machine, and whether it can take part in
    shared-memory collectives (see `ShmCommunicator.available`)."""

    machines: tuple[str, ...]
    shared_memory: tuple[bool, ...]

    def ranks_on_machine_of(self, rank: int) -> list[int]:
        """The ranks on `rank`'s machine, `rank` included, ascending."""
        return [r for r, machine in enumerate(self.machines) if machine == self.machines[rank]]

    @property
    def one_machine_with_shared_memory(self) -> bool:
        """Every rank on one machine, and every one of them able to map shared memory."""
        return len(set(self.machines)) == 1 and all(self.shared_memory)


def exchange_machine_layout(store: dist.Store, rank: int, world_size: int, timeout_s: float,
                            shared_memory: bool) -> MachineLayout:
    """Collective over the ranks of `store`: publishes this rank's machine and whether it can
    use shared memory, and returns every rank's."""
    store.set(_KEY.format(rank=rank), json.dumps({"machine": machine_id(), "shared_memory": shared_memory}))
    keys = [_KEY.format(rank=r) for r in range(world_size)]
    store.wait(keys, timedelta(seconds=timeout_s))
    records = [_parse(store.get(key), r) for r, key in enumerate(keys)]
    return MachineLayout(machines=tuple(machine for machine, _ in records),
                         shared_memory=tuple(shared for _, shared in records))


def _parse(value: bytes, rank: int) -> tuple[str, bool]:
    try:
        record = json.loads(value)
        return str(record["machine"]), record["shared_memory"] is True
    except (ValueError, TypeError, KeyError) as e:
        raise RuntimeError(f"The rendezvous store holds no machine layout for tensor-parallel rank {rank} "
                           f"({value[:100]!r}): something other than a rank wrote it.") from e

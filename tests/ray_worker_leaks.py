"""The engine's Ray worker actors (`RayWorkerWrapper`) alive in this process's Ray, read
from the GCS actor table (Ray's state API needs the dashboard, which the tests' Ray runs
without). conftest's `no_leaked_ray_workers` compares them before and after each test
module: a worker nobody shut down keeps its process (and, inside a compiled graph, a loop
waiting on its channel) until the whole Ray ends, and takes CPU from every test after it."""

from __future__ import annotations

import gc
import os
import signal
import sys
import time
from dataclasses import dataclass

WORKER_CLASS_NAME = "RayWorkerWrapper"
# Every state but DEAD: a worker still being created or restarted holds its bundle too.
_LIVE_STATES = ("DEPENDENCIES_UNREADY", "PENDING_CREATION", "ALIVE", "RESTARTING")
# How long a worker killed by a finalizer (run by gc.collect) may take to show as DEAD.
_DEATH_WAIT_S = 5.0


@dataclass(frozen=True)
class WorkerActor:
    actor_id: str
    pid: int
    state: str


def live_worker_actors() -> dict[str, WorkerActor]:
    """The engine's worker actors not yet dead, by actor id; none when Ray is not running
    in this process."""
    # A module that never imported Ray started none: do not pay for importing it here.
    if "ray" not in sys.modules:
        return {}
    import ray
    from ray._private import state as ray_state

    if not ray.is_initialized():
        return {}
    actors = {}
    for state in _LIVE_STATES:
        for actor_id, info in ray_state.actors(actor_state_name=state).items():
            if info["ActorClassName"] == WORKER_CLASS_NAME:
                actors[actor_id] = WorkerActor(actor_id, info["Pid"], state)
    return actors


def leaked_worker_actors(before: dict[str, WorkerActor]) -> tuple[list[WorkerActor], list[WorkerActor]]:
    """The workers alive now that were not in `before`, split into those a garbage
    collection ended (an engine nobody shut down, freed only by its finalizer once
    collected: it would live until Python's collector happened to run) and those still
    alive after it (an engine still referenced, or one whose shutdown leaves workers)."""
    new = {actor_id: actor for actor_id, actor in live_worker_actors().items() if actor_id not in before}
    if not new:
        return [], []
    gc.collect()
    deadline = time.monotonic() + _DEATH_WAIT_S
    while True:
        alive = {actor_id for actor_id in live_worker_actors() if actor_id in new}
        if not alive or time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    ended_by_gc = [actor for actor_id, actor in new.items() if actor_id not in alive]
    still_alive = [actor for actor_id, actor in new.items() if actor_id in alive]
    return ended_by_gc, still_alive


def end_workers(actors: list[WorkerActor]) -> None:
    """Ends leaked workers so that they do not slow the modules after the one that leaked
    them: shuts down the executors still holding them (a failed test's traceback, which
    pytest keeps, holds its engine), then kills the processes of any left (every node of
    the tests' clusters is on this machine)."""
    from raylm.executors.ray_distributed_executor import RayDistributedExecutor

    leaked = {actor.actor_id for actor in actors}
    for executor in [obj for obj in gc.get_objects() if isinstance(obj, RayDistributedExecutor)]:
        if any(worker._actor_id.hex() in leaked for worker in executor.workers):
            executor.shutdown()
    still_alive = live_worker_actors()
    for actor in actors:
        if actor.actor_id in still_alive and actor.pid > 0:
            try:
                os.kill(actor.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

"""How many threads a worker computes with on the CPU, and how its idle OpenMP threads wait.

**Thread count** (`worker_thread_count`). An `OMP_NUM_THREADS` the user set wins (on a Ray
cluster, set it in the driver's environment: the driver passes it on to its workers).
Otherwise a worker takes the CPUs its Ray bundle reserves when that is one or more
(`ray_cpus_per_worker`, rounded down), else (the default 0.5, a share in Ray's accounting
only, or a GPU bundle) its share of the machine's cores: all of them for one worker, split
evenly between the tensor-parallel ranks on one machine, and never more than the machine
has. An in-process engine is one worker on its machine: every core.

Ray gives each actor `OMP_NUM_THREADS` = the CPUs it reserves, at least 1, and `ray up`
exports `OMP_NUM_THREADS=1` for a node's processes: left alone, a worker in a 0.5-CPU bundle
computed with one thread where the in-process engine used every core (a batch-64 decode step
of the 5M benchmark Llama on 2 cores: 7.9-8.4 ms in a Ray worker, 4.6-5.1 ms in process). So
a value Ray set is not the user's: inside a Ray worker only one that came through the
runtime environment counts.

**Waiting: OMP_WAIT_POLICY** (`apply_openmp_defaults`). Between parallel regions GNU
OpenMP's threads spin (300,000 polls by default) before they sleep. On a machine whose cores
are busy with other work a spinning thread holds a core that a descheduled teammate or the
neighbours need, and every parallel region waits for its slowest thread. On the project's
2-core machine (already loaded by other work, load average 6-20), a 64-token request of the
demo model with 2 threads took 0.6-9.6 s spinning and 0.05-0.48 s with idle threads
sleeping; with two more busy loops, 5.0-26 s against 0.11-0.29 s (one thread: 0.29-0.44 s).
raylm therefore sets `OMP_WAIT_POLICY=PASSIVE` (idle threads sleep at once) when
`raylm.engine` or `raylm.cluster` is imported, unless the environment already says how
OpenMP threads wait (`OMP_WAIT_POLICY`, `GOMP_SPINCOUNT`, or Intel OpenMP's `KMP_BLOCKTIME`);
Ray workers get the driver's setting. OpenMP reads it once, when torch loads: import raylm
before torch, or export it yourself (raylm warns when torch came first). On a machine that
runs nothing else, spinning threads can answer a little sooner: `OMP_WAIT_POLICY=ACTIVE`
(spin until work comes) or `GOMP_SPINCOUNT=N` (spin N polls, then sleep) choose that.
"""

from __future__ import annotations

import logging
import math
import os
import sys

logger = logging.getLogger(__name__)

THREADS_VAR = "OMP_NUM_THREADS"
# What raylm sets when the environment has none of _WAIT_SETTINGS.
OPENMP_DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE"}
# Any of these means the user chose how OpenMP threads wait: raylm then sets nothing.
_WAIT_SETTINGS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")
# The variables a Ray worker must get from the driver, set before its torch loads.
OPENMP_VARIABLES = (THREADS_VAR, *_WAIT_SETTINGS)


# Whether this process's OpenMP runs with raylm's defaults or the user's settings: False
# when torch had loaded before apply_openmp_defaults set them.
_wait_settings_in_force = True


def apply_openmp_defaults(environ: os._Environ | dict[str, str] = os.environ) -> dict[str, str]:
    """Sets OPENMP_DEFAULTS in `environ` unless it sets how OpenMP threads wait; returns
    what it set. Affects this process only if torch has not loaded yet, and the processes
    started from it (Ray workers get them through `openmp_environment_for_workers`)."""
    global _wait_settings_in_force
    if any(name in environ for name in _WAIT_SETTINGS):
        return {}
    if environ is os.environ and "torch" in sys.modules:
        _wait_settings_in_force = False
    environ.update(OPENMP_DEFAULTS)
    return dict(OPENMP_DEFAULTS)


def warn_if_openmp_started_first(threads: int) -> None:
    """Logs once if this process computes with several threads whose OpenMP started before
    raylm could set how they wait (torch was imported before raylm)."""
    global _wait_settings_in_force
    if _wait_settings_in_force or threads < 2:
        return
    _wait_settings_in_force = True  # once
    logger.warning("torch was imported before raylm, so its OpenMP threads spin while idle (%s was set too late): "
                   "on a machine busy with other work every step then waits for them. Import raylm first, or "
                   "export %s before starting Python.", ", ".join(f"{k}={v}" for k, v in OPENMP_DEFAULTS.items()),
                   " ".join(f"{k}={v}" for k, v in OPENMP_DEFAULTS.items()))


def openmp_environment_for_workers() -> dict[str, str]:
    """The OpenMP variables a worker process should start with: the wait settings in force
    here, and OMP_NUM_THREADS only if the user chose it (`user_thread_count`)."""
    env = {name: os.environ[name] for name in _WAIT_SETTINGS if name in os.environ}
    threads = user_thread_count()
    if threads is not None:
        env[THREADS_VAR] = str(threads)
    return env


def user_thread_count() -> int | None:
    """OMP_NUM_THREADS as the user set it; None when it is unset, not a positive integer,
    or set by Ray (in a Ray worker, unless it came through the runtime environment)."""
    value = os.environ.get(THREADS_VAR, "").strip()
    if not value.isdigit() or int(value) < 1:
        return None
    if _in_ray_worker() and THREADS_VAR not in _runtime_env_vars():
        return None
    return int(value)


def worker_thread_count(cores: int, ranks_sharing: int, reserved_cpus: float | None,
                        user_threads: int | None) -> int:
    """The threads of a worker with `cores` usable cores shared by `ranks_sharing` ranks
    (1 when the cores are its own already), `reserved_cpus` reserved for it by Ray (None
    outside Ray) and the user's OMP_NUM_THREADS (None if unset)."""
    if user_threads is not None:
        return user_threads
    share = max(1, cores // max(1, ranks_sharing))
    if reserved_cpus is not None and reserved_cpus >= 1:
        return min(share, math.floor(reserved_cpus))
    return share


def _in_ray_worker() -> bool:
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return False
    from ray._private.worker import WORKER_MODE, global_worker

    return global_worker.mode == WORKER_MODE


def _runtime_env_vars() -> dict[str, str]:
    import ray

    return dict((ray.get_runtime_context().runtime_env or {}).get("env_vars") or {})

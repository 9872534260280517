"""How many threads a worker computes with on the CPU, and how its idle OpenMP threads wait.

**Thread count** (`worker_thread_count`). An `OMP_NUM_THREADS` the user set wins (on a Ray
cluster, set it in the driver's environment: the driver passes it on to its workers).
Otherwise a worker takes the cores its Ray bundle reserves when that is one or more CPUs
(`ray_cpus_per_worker`, rounded down), else (the default 0.5, a share of Ray's accounting,
or a GPU bundle) its share of the machine's cores: all of them for one worker, split evenly
between the tensor-parallel ranks of one machine, never more than the machine has. An
in-process engine is one worker on its machine: every core.

Ray gives each actor `OMP_NUM_THREADS` = the CPUs it reserves, at least 1, and `ray up`
exports `OMP_NUM_THREADS=1` for the node's processes; left alone, a worker in a 0.5-CPU
bundle computed with one thread where the in-process engine used all of the machine's
cores (a batch-64 decode step of the 5M benchmark Llama on 2 cores: 7.9-8.4 ms in a Ray
worker, 4.6-5.1 ms in process). So a value Ray set is not the user's: inside a Ray worker
only one that came through the runtime environment counts.

**Waiting** (`apply_openmp_defaults`). Between parallel regions, GNU OpenMP's threads spin
for a while (about 300,000 polls) before they sleep. On a machine whose cores are busy with
other work, a spinning thread holds a core that a descheduled teammate or the neighbours
need, and every parallel region waits for the slowest thread: with two busy loops on the
2-core machine, a 64-token request took 1.0-3.0 s instead of 0.06 s. raylm therefore sets
`OMP_WAIT_POLICY=PASSIVE` (idle threads sleep at once) when importing `raylm.engine`, unless
the environment already sets `OMP_WAIT_POLICY` or `GOMP_SPINCOUNT`; its workers on Ray get
the same setting. OpenMP reads it once, when torch loads: import raylm before torch, or
export it yourself. On a dedicated machine, `OMP_WAIT_POLICY=ACTIVE` can be slightly faster
(see `docs/performance.md` for the measured cost of each).
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

"""Executors run scheduled steps on workers: in this process (`UniProcExecutor`) or as Ray
actors (`RayDistributedExecutor`, imported from its module so that offline use on one
worker never imports Ray).

The names below load on first use, so that `raylm.executors.cpu_threads` can set OpenMP's
environment before anything imports torch."""

_LAZY = {
    "Executor": "raylm.executors.executor_base",
    "UniProcExecutor": "raylm.executors.uniproc_executor",
    "Worker": "raylm.executors.worker",
}

__all__ = ["Executor", "UniProcExecutor", "Worker"]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'raylm.executors' has no attribute {name!r}")

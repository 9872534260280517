"""Executors run scheduled steps on workers: in this process (`UniProcExecutor`) or as Ray
actors (`RayDistributedExecutor`, imported from its module so that offline use on one
worker never imports Ray)."""

from raylm.executors.executor_base import Executor
from raylm.executors.uniproc_executor import UniProcExecutor
from raylm.executors.worker import Worker

__all__ = ["Executor", "UniProcExecutor", "Worker"]

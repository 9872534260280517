"""Executors run scheduled steps on workers: the in-process one here, Ray's later."""

from raylm.executors.executor_base import Executor
from raylm.executors.uniproc_executor import UniProcExecutor
from raylm.executors.worker import Worker

__all__ = ["Executor", "UniProcExecutor", "Worker"]

"""Runs the one worker of a single-device engine in the engine's own process."""

from __future__ import annotations

from typing import Any

from raylm.engine.step import ExecuteModelRequest, SamplerOutput
from raylm.executors.executor_base import Executor
from raylm.executors.worker import Worker


class UniProcExecutor(Executor):
    def _init_executor(self) -> None:
        if self.parallel_config.tensor_parallel_size != 1:
            raise ValueError(f"tensor_parallel_size {self.parallel_config.tensor_parallel_size} needs the Ray "
                             f"executor; the in-process executor runs exactly 1 worker.")
        self.driver_worker = Worker(self.engine_config, rank=0, local_rank=0)
        self.driver_worker.init_device()
        self.driver_worker.load_model()

    def determine_num_available_blocks(self) -> int:
        return self.driver_worker.determine_num_available_blocks()

    def initialize_cache(self, num_blocks: int) -> None:
        self.cache_config.num_gpu_blocks = num_blocks
        self.driver_worker.initialize_cache(num_blocks)

    def collective_rpc(self, method: str, *args: Any, timeout: float | None = None) -> list[Any]:
        return [getattr(self.driver_worker, method)(*args)]

    def execute_model(self, req: ExecuteModelRequest) -> SamplerOutput:
        return self.driver_worker.execute_model(req)

    def check_health(self) -> None:
        self.driver_worker.check_health()

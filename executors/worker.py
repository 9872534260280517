"""One worker per device (one per tensor-parallel rank): owns the model replica shard,
its KV cache partition and a `ModelRunner`."""

from __future__ import annotations

import os

import torch

from raylm.engine.config import EngineConfig
from raylm.engine.step import ExecuteModelRequest, SamplerOutput
from raylm.executors.model_runner import ModelRunner


class Worker:
    def __init__(self, engine_config: EngineConfig, rank: int = 0, local_rank: int = 0,
                 distributed_init_method: str | None = None) -> None:
        self.engine_config = engine_config
        self.rank = rank
        self.local_rank = local_rank
        self.distributed_init_method = distributed_init_method
        self.device: torch.device | None = None
        self.model_runner: ModelRunner | None = None

    def init_device(self) -> None:
        """Picks the device, sizes the CPU thread pool and seeds the global RNGs."""
        device_type = self.engine_config.device_config.device
        if device_type == "cuda":
            self.device = torch.device("cuda", self.local_rank)
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
            # Ranks of one machine share its cores: give each its share rather than letting
            # every rank oversubscribe all of them.
            tp = self.engine_config.parallel_config.tensor_parallel_size
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
            torch.set_num_threads(max(1, cores // tp))
        torch.manual_seed(self.engine_config.model_config.seed)
        self.model_runner = ModelRunner(self.engine_config, self.rank, self.device)

    def load_model(self) -> None:
        self.model_runner.load_model()

    def determine_num_available_blocks(self) -> int:
        return self.model_runner.determine_num_available_blocks()

    def get_cache_block_size_bytes(self) -> int:
        return self.model_runner.get_cache_block_size_bytes()

    def initialize_cache(self, num_blocks: int) -> None:
        self.engine_config.cache_config.num_gpu_blocks = num_blocks
        self.model_runner.initialize_cache(num_blocks)

    def execute_model(self, req: ExecuteModelRequest) -> SamplerOutput | None:
        """The step's sampled tokens on rank 0; None on the other ranks."""
        return self.model_runner.execute_model(req)

    def check_health(self) -> None:
        """Raises if the device can no longer run work."""
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

"""The interface the engine drives workers through, whatever runs them (in process, Ray)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from raylm.engine.config import EngineConfig
from raylm.engine.step import ExecuteModelRequest, SamplerOutput


class Executor(ABC):
    # Whether execute_model_async returns while the workers still run the step (they live
    # in other processes), leaving the driver free to work until it waits.
    runs_steps_asynchronously: bool = False

    def __init__(self, engine_config: EngineConfig) -> None:
        self.engine_config = engine_config
        self.model_config = engine_config.model_config
        self.cache_config = engine_config.cache_config
        self.parallel_config = engine_config.parallel_config
        self._init_executor()

    @abstractmethod
    def _init_executor(self) -> None:
        """Starts the workers, loads the model on each."""

    @abstractmethod
    def determine_num_available_blocks(self) -> int:
        """KV blocks every worker can hold (the minimum over workers)."""

    @abstractmethod
    def initialize_cache(self, num_blocks: int) -> None:
        """Allocates num_blocks KV blocks on every worker."""

    @abstractmethod
    def execute_model(self, req: ExecuteModelRequest) -> SamplerOutput:
        """Runs one step on every worker and returns rank 0's sampler output."""

    def execute_model_async(self, req: ExecuteModelRequest) -> Callable[[], SamplerOutput]:
        """Starts one step; the returned function waits for it and returns rank 0's sampler
        output (raising as execute_model would). Call it exactly once, before the next
        step starts. Here the step runs at once; executors whose workers run elsewhere (Ray)
        or in a thread of their own (the in-process executor on a GPU) return before it
        ends, and say so in runs_steps_asynchronously."""
        output = self.execute_model(req)
        return lambda: output

    def collective_rpc(self, method: str, *args: Any, timeout: float | None = None) -> list[Any]:
        """Calls `Worker.<method>(*args)` on every worker; the results in rank order."""
        raise NotImplementedError(f"{type(self).__name__} does not call worker methods.")

    def add_lora(self, lora_request: Any, digest: Any = None) -> None:
        """Loads a LoRA adapter into every worker's host memory (each its share), from the
        bytes of `digest` (the engine's check of its files); raises LoRAAdapterError (a
        ValueError) for an adapter the workers cannot serve. Safe to call from a thread other
        than the one that runs steps."""
        from raylm.executors.lora_adapter import lora_error_from_worker

        for error in self.collective_rpc("add_lora", lora_request, digest):
            if error is not None:
                raise lora_error_from_worker(*error)

    def remove_lora(self, lora_int_id: int) -> None:
        """Drops an adapter from every worker's host memory."""
        self.collective_rpc("remove_lora", lora_int_id)

    def check_health(self) -> None:
        """Raises if a worker is no longer able to run steps."""

    def shutdown(self) -> None:
        """Releases the workers; safe to call twice."""

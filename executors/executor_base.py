"""The interface the engine drives workers through, whatever runs them (in process, Ray)."""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from raylm.engine.config import EngineConfig
from raylm.engine.step import ExecuteModelRequest, SamplerOutput

logger = logging.getLogger(__name__)

# vLLM's memory tags: what LLM.wake_up(tags=...) restores.
SLEEP_TAGS = ("weights", "kv_cache")


class Executor(ABC):
    # Whether execute_model_async returns while the workers still run the step (they live
    # in other processes), leaving the driver free to work until it waits.
    runs_steps_asynchronously: bool = False

    def __init__(self, engine_config: EngineConfig) -> None:
        # Sleep mode: the memory tags ("weights", "kv_cache") the workers have freed.
        self.sleeping_tags: set[str] = set()
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

    def collective_rpc(self, method: str | Callable, *args: Any, timeout: float | None = None,
                       kwargs: dict[str, Any] | None = None, raised_is_fatal: bool = True) -> list[Any]:
        """Calls `Worker.<method>(*args, **kwargs)` on every worker, or `method(worker, *args,
        **kwargs)` for a callable (vLLM's); the results in rank order. An exception the method
        raises fails the workers for good (the engine's own calls: a worker left half done),
        unless raised_is_fatal is False (a user's call): then it is raised as it is."""
        raise NotImplementedError(f"{type(self).__name__} does not call worker methods.")

    # ---- sleep mode (vLLM's executor state: which memory is asleep) ---------------------------
    def sleep(self, level: int = 1) -> None:
        """Frees every worker's KV cache and (on a GPU) weights; see `Worker.sleep`."""
        if self.is_sleeping:
            logger.warning("The executor is already asleep.")
            return
        self.collective_rpc("sleep", level)
        self.sleeping_tags = set(SLEEP_TAGS)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restores the memory of `tags` (None: all) on every worker."""
        if not self.is_sleeping:
            logger.warning("The executor is not asleep.")
            return
        waking = [tag for tag in (SLEEP_TAGS if tags is None else tags) if tag in self.sleeping_tags]
        if waking:
            self.collective_rpc("wake_up", waking)
        self.sleeping_tags -= set(waking)

    @property
    def is_sleeping(self) -> bool:
        return bool(self.sleeping_tags)

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

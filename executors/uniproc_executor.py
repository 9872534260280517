"""Runs the one worker of a single-device engine in the engine's own process.

On a GPU the worker runs its steps in a thread of its own, so that `execute_model_async`
returns once the step is handed over: the driver then schedules the next step and turns
the last one's tokens into text while the GPU computes (the overlap the Ray executor gets
from its workers being other processes; the engine core turns on async scheduling for
it). The forward mostly waits on the GPU, and waiting releases the GIL. On the CPU the
forward itself needs the cores the driver would use, so steps run in the caller's thread.

The step thread also keeps the GPU from waiting for the host between steps: it launches a
step with its read deferred (`ModelRunner.execute_model(defer_read=True)`), then launches
the next one, whose inputs take the first step's tokens on the device, and only then reads
the first step's tokens. The host's work for a step (its inputs, the sampler's launches)
so runs while the GPU still computes the step before it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from raylm.engine.step import ExecuteModelRequest, SamplerOutput
from raylm.executors.executor_base import Executor
from raylm.executors.model_runner import DeferredSamplerOutput
from raylm.executors.worker import run_worker_method, worker_class


class UniProcExecutor(Executor):
    # Devices whose steps run in the step thread (tests add "cpu" to check the overlap).
    step_thread_devices: tuple[str, ...] = ("cuda",)

    def _init_executor(self) -> None:
        if self.parallel_config.tensor_parallel_size != 1:
            raise ValueError(f"tensor_parallel_size {self.parallel_config.tensor_parallel_size} needs the Ray "
                             f"executor; the in-process executor runs exactly 1 worker.")
        self.driver_worker = worker_class(self.engine_config)(self.engine_config, rank=0, local_rank=0)
        self.driver_worker.init_device()
        self.driver_worker.load_model()
        self.runs_steps_asynchronously = self.engine_config.device_config.device in self.step_thread_devices
        self._step_thread: ThreadPoolExecutor | None = None
        if self.runs_steps_asynchronously:
            self._step_thread = ThreadPoolExecutor(1, thread_name_prefix="raylm-step",
                                                   initializer=self.driver_worker.enter_step_thread)
        # Held while a step runs; shutdown takes it, so memory is never freed under a step.
        self._lock = threading.Lock()
        self._shut_down = False
        # The step launched with its read deferred, and the future its tokens resolve;
        # touched under _lock only.
        self._pending: tuple[Future, DeferredSamplerOutput] | None = None

    def determine_num_available_blocks(self) -> int:
        return self.driver_worker.determine_num_available_blocks()

    def initialize_cache(self, num_blocks: int) -> None:
        self.cache_config.num_gpu_blocks = num_blocks
        self.driver_worker.initialize_cache(num_blocks)

    def collective_rpc(self, method: str | Callable, *args: Any, timeout: float | None = None,
                       kwargs: dict[str, Any] | None = None, raised_is_fatal: bool = True) -> list[Any]:
        # The worker is in this process: its exceptions reach the caller, never fail it for good.
        return [run_worker_method(self.driver_worker, method, args, kwargs)]

    def execute_model(self, req: ExecuteModelRequest) -> SamplerOutput:
        """Runs one step in the calling thread."""
        with self._lock:
            self._check_running()
            self._collect_pending()
            return self.driver_worker.execute_model(req)

    def execute_model_async(self, req: ExecuteModelRequest) -> Callable[[], SamplerOutput]:
        if self._step_thread is None:
            return super().execute_model_async(req)
        result: Future = Future()
        self._step_thread.submit(self._launch_step, req, result)
        return lambda: self._wait(result)

    def _launch_step(self, req: ExecuteModelRequest, result: Future) -> None:
        """Step thread: launches this step, then collects the one launched before it (its
        tokens, which this step took on the device, are read while this step computes)."""
        with self._lock:
            try:
                self._check_running()
                if self._pending is not None and self.driver_worker.model_runner.needs_collected_tokens(req):
                    self._collect_pending()
                output = self.driver_worker.execute_model(req, defer_read=True)
            except BaseException as exc:
                self._collect_pending()
                result.set_exception(exc)
                return
            self._collect_pending()
            if isinstance(output, DeferredSamplerOutput):
                self._pending = (result, output)
            else:
                result.set_result(output)

    def _wait(self, result: Future) -> SamplerOutput:
        """A step's output. One launched last is collected only when asked for (or when
        the next step is launched): with nothing queued behind it, the step thread is asked."""
        if not result.done():
            try:
                self._step_thread.submit(self._collect_if_pending, result)
            except RuntimeError:  # shut down: shutdown() collected it
                pass
        return result.result()

    def _collect_if_pending(self, result: Future) -> None:
        """Step thread: collects the deferred step `result` waits for, if no later launch
        has (a later step must not be collected early: it would lose the overlap)."""
        with self._lock:
            if self._pending is not None and self._pending[0] is result:
                self._collect_pending()

    def _collect_pending(self) -> None:
        """Reads the deferred step's tokens into its future (caller holds _lock)."""
        if self._pending is None:
            return
        result, deferred = self._pending
        self._pending = None
        try:
            result.set_result(deferred.collect())
        except BaseException as exc:
            result.set_exception(exc)

    def _check_running(self) -> None:
        if self._shut_down:
            raise RuntimeError("The engine has been shut down: its worker runs no more steps.")

    def check_health(self) -> None:
        self.driver_worker.check_health()

    def shutdown(self) -> None:
        """Waits for a step in flight, then frees the KV cache, the CUDA graphs and the
        model, so that another engine can take the memory; safe to call twice."""
        if self._step_thread is not None:
            self._step_thread.shutdown(wait=True)
        with self._lock:
            if self._shut_down:
                return
            self._collect_pending()
            self._shut_down = True
            self.driver_worker.shutdown()

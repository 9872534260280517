"""`AsyncLLMEngine`: an `LLMEngine` stepped by a background task, for servers.

Many coroutines call `generate()` at once; each gets an async iterator of its own
`RequestOutput`s. One background task owns the engine: between steps it adds the queued
requests and applies the queued aborts, then runs `LLMEngine.step()` in a worker thread
(so the event loop keeps serving HTTP while the model runs) and routes each output to its
request's stream. The engine is never touched from two threads at once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from raylm.engine.arg_utils import EngineArgs
from raylm.engine.beam_search import (BeamSearchDriver, BeamSearchOutput, BeamSearchParams, StepRequests,
                                      beam_search_params_from, beam_search_request_output, run_async)
from raylm.engine.llm_engine import LLMEngine, PromptType, cache_salt_of
from raylm.engine.lora_request import LoRARequest
from raylm.engine.outputs import CompletionOutput, PoolingRequestOutput, RequestOutput
from raylm.engine.pooling_params import PoolingParams
from raylm.engine.sampling_params import ParameterError, RequestOutputKind, SamplingParams
from raylm.engine.structured_output.params import StructuredOutputsParams
from raylm.engine.usage_context import UsageContext

logger = logging.getLogger(__name__)


class AsyncEngineDeadError(RuntimeError):
    """The engine loop stopped on an error: no request can run until a restart."""


@dataclass
class FinishedRequestStats:
    """What the metrics need to know about a request when it ends."""

    request_id: str
    finish_reasons: list[str | None]
    num_prompt_tokens: int
    num_generation_tokens: int
    arrival_time: float
    first_token_time: float | None
    finished_time: float


@dataclass
class _RequestState:
    """One request as the async layer sees it: its queue of outputs for the caller and
    whether it has ended.

    `engine_request_id` is the id the `LLMEngine` knows it by, unique per add: a caller may
    reuse `request_id` after an abort while the engine still steps the old request, and
    the old request's outputs must not reach the new stream. A beam of a beam search holds
    its search's `request_id` but is known by its engine id alone (see `_add_requests`).
    """

    request_id: str
    engine_request_id: str
    arrival_time: float
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    finished: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # vLLM's request priority (scheduling_policy "priority"; 0 otherwise).
    priority: int = 0


@dataclass(eq=False)
class _BeamSearchHandle:
    """A running beam search under its caller's id: `task` runs it (None while the
    `use_beam_search` first step is being added); `aborted` once `abort` ended it."""

    task: asyncio.Task | None = None
    aborted: bool = False

    def abort(self) -> None:
        self.aborted = True
        if self.task is not None:
            self.task.cancel()


@dataclass
class _PendingWork:
    """Aborts, adds and calls taken off the queues together, for the engine's thread."""

    aborts: set[str]
    adds: list[tuple[_RequestState, PromptType, SamplingParams, LoRARequest | None, asyncio.Future]]
    calls: list[tuple[Callable[[], Any], asyncio.Future]]

    def __bool__(self) -> bool:
        return bool(self.aborts or self.adds or self.calls)


_STREAM_END = object()
# Steps whose outputs the step thread may have handed to the event loop before the loop
# has delivered them to their streams.
_MAX_UNDELIVERED_STEPS = 4


class RequestStream:
    """The outputs of one request, an async iterator that `AsyncLLMEngine.add_request`
    returns.

    Closing it (`aclose()`), dropping it, or cancelling a task that waits on it before the
    request finished aborts the request, whether or not it was ever read: its blocks go
    back to the pool before the next step. After a finished output, or after an abort or
    an error, iteration stops.
    """

    def __init__(self, engine: "AsyncLLMEngine", state: _RequestState) -> None:
        self._engine = engine
        self._state = state
        self._loop = asyncio.get_running_loop()
        self._done = False
        # An item taken from the queue while catching up, not returned yet.
        self._held: Any = None

    @property
    def request_id(self) -> str:
        return self._state.request_id

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        if self._held is not None:
            item, self._held = self._held, None
        else:
            try:
                item = await self._state.queue.get()
            except asyncio.CancelledError:
                self.close()
                raise
        if isinstance(item, RequestOutput) and not item.finished:
            item = self._catch_up(item)
        if item is _STREAM_END:
            self._done = True
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self._done = True
            raise item
        if item.finished:
            self._done = True
        return item

    def _catch_up(self, output: RequestOutput) -> RequestOutput:
        """A reader that fell behind gets what is queued as one output, as vLLM's output
        collector does: the newest for cumulative outputs, the concatenation for deltas.
        Under load this saves a chunk per token per stream on the server and the client."""
        queue = self._state.queue
        while not queue.empty():
            newer = queue.get_nowait()
            if not isinstance(newer, RequestOutput):
                self._held = newer  # the end or an error: after what came before it
                break
            output = _merge_delta(output, newer) if self._state.output_kind == RequestOutputKind.DELTA else newer
            if output.finished:
                break
        return output

    def close(self) -> None:
        """Stops reading; aborts the request unless it already ended."""
        self._done = True
        if not self._state.finished:
            self._engine._abort_state(self._state)

    async def aclose(self) -> None:
        self.close()

    def __del__(self) -> None:
        # The last reference may go on any thread (a GC run in the engine's step thread),
        # so the abort is handed to the event loop.
        if not self._state.finished:
            try:
                self._loop.call_soon_threadsafe(self._engine._abort_state, self._state)
            except RuntimeError:  # the loop is closed: nothing runs the request any more
                pass


class AsyncLLMEngine:
    """Serves many concurrent requests from one `LLMEngine`.

    Args:
        engine: The engine to drive. The async engine owns it from now on.
        step_in_thread: Run each `step()` in a worker thread (default) so the event loop
            stays responsive; False runs it on the loop itself, yielding between steps.
        step_thread_pool: The one-thread pool to step in, if the engine was built on its
            thread (see `from_engine_args`); default: a new one.

    Use `generate()` from any coroutine of one event loop; the background loop starts on
    the first request. `is_running` says whether it takes requests; `check_health()`
    raises once the loop has died (`errored`); from then on every waiting and new request
    fails with `AsyncEngineDeadError`. `beam_search()` runs a beam search on it, as
    `LLM.beam_search` does offline.
    """

    def __init__(self, engine: LLMEngine, step_in_thread: bool = True,
                 step_thread_pool: concurrent.futures.ThreadPoolExecutor | None = None) -> None:
        self.engine = engine
        self.step_in_thread = step_in_thread
        # Unfinished requests by the caller's id and by the engine's (see _RequestState).
        self._requests: dict[str, _RequestState] = {}
        self._engine_requests: dict[str, _RequestState] = {}
        # Running beam searches by the caller's id (their beams are requests known by
        # engine ids alone): `abort` cancels them, a second request of the id is refused.
        self._beam_searches: dict[str, _BeamSearchHandle] = {}
        self._add_counter = itertools.count()
        # Work for the engine's thread, queued on the event loop (see _take_pending).
        self._pending_adds: list[tuple[_RequestState, PromptType, SamplingParams, LoRARequest | None,
                                       asyncio.Future]] = []
        self._pending_aborts: set[str] = set()
        self._pending_calls: list[tuple[Callable[[], Any], asyncio.Future]] = []
        self._work_in_flight: _PendingWork | None = None
        self._wakeup: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self._thread_pool = step_thread_pool or _step_thread_pool()
        # Set on the event loop when requests wait to be added or aborted: the step thread
        # then returns after its current step (see _run_steps).
        self._interrupt = threading.Event()
        self._undelivered_steps = threading.BoundedSemaphore(_MAX_UNDELIVERED_STEPS)
        self._dead_error: BaseException | None = None
        self._stats_listeners: list[Callable[[FinishedRequestStats], None]] = []
        self._shutdown = False

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, step_in_thread: bool = True,
                         usage_context: UsageContext = UsageContext.ENGINE_CONTEXT) -> "AsyncLLMEngine":
        """Builds the engine on the thread that will run its steps. The model's load and
        the KV cache's allocation run torch's parallel ops, and each thread that does so
        gets its own OpenMP thread team: two teams on the same cores slowed every step of
        the ~100M bf16 Llama by 28% (5.0 against 3.9 s for 128 steps)."""
        in_process = (engine_args.tensor_parallel_size == 1 and engine_args.pipeline_parallel_size == 1
                      and engine_args.distributed_executor_backend in (None, "uni"))
        if not (step_in_thread and in_process):
            # Ray workers compute in their own processes; Ray itself is joined from the
            # caller's (main) thread.
            return cls(LLMEngine.from_engine_args(engine_args, usage_context), step_in_thread=step_in_thread)
        pool = _step_thread_pool()
        try:
            engine = pool.submit(LLMEngine.from_engine_args, engine_args, usage_context).result()
        except BaseException:
            pool.shutdown(wait=False)
            raise
        return cls(engine, step_thread_pool=pool)

    # --------------------------------------------------------------- properties
    @property
    def model_config(self) -> Any:
        return self.engine.model_config

    @property
    def scheduler(self) -> Any:
        return self.engine.scheduler

    @property
    def num_prompt_tokens_total(self) -> int:
        """Prompt tokens of the requests accepted since start (for the metrics endpoint)."""
        return self.engine.num_prompt_tokens_total

    @property
    def num_generation_tokens_total(self) -> int:
        """Tokens generated since start (for the metrics endpoint)."""
        return self.engine.engine_core.num_generation_tokens_total

    def get_tokenizer(self) -> Any:
        return self.engine.get_tokenizer()

    @property
    def is_running(self) -> bool:
        """True while the engine can take requests: from construction (its loop starts
        with the first request) until `shutdown()` or the loop's death (then `errored`).
        vLLM's `AsyncLLM.is_running`."""
        if self._shutdown or self._dead_error is not None:
            return False
        return self._loop_task is None or not self._loop_task.done()

    @property
    def errored(self) -> bool:
        return self._dead_error is not None

    @property
    def num_unfinished_requests(self) -> int:
        """Running requests by the caller's ids, a beam search counting once."""
        return len(self._requests) + len(self._beam_searches)

    async def recent_cached_block_hashes(self, limit: int) -> list[bytes]:
        """Up to `limit` block hashes of the prefix cache, most recently used first, read
        on the engine's thread between steps (what a Serve replica reports to the
        prefix-aware router)."""
        kv_cache_manager = self.scheduler.kv_cache_manager
        return await self._on_engine_thread(functools.partial(kv_cache_manager.recent_cached_block_hashes, limit))

    def add_stats_listener(self, listener: Callable[[FinishedRequestStats], None]) -> None:
        """Calls `listener` on the event loop each time a request finishes (not aborted)."""
        self._stats_listeners.append(listener)

    # ----------------------------------------------------------------- requests
    async def add_request(self, request_id: str, prompt: PromptType,
                          params: SamplingParams | PoolingParams | None = None,
                          arrival_time: float | None = None, lora_request: LoRARequest | None = None,
                          priority: int = 0) -> RequestStream:
        """Queues a request and waits until the engine has accepted it.

        Raises ValueError for a bad request (the engine's validation) and
        AsyncEngineDeadError when the engine is dead; otherwise returns the stream of
        its outputs. Closing or dropping that stream before the request finished (break,
        cancellation, `aclose()`, even before reading it) aborts the request. The id may be
        reused once the request has ended or been aborted. `lora_request` runs it under a
        LoRA adapter (needs enable_lora). `priority` (vLLM's): under scheduling_policy
        "priority", lower is scheduled first (ties by arrival); it must be 0 under "fcfs".

        vLLM 0.4's `SamplingParams(use_beam_search=True)` runs a beam search (see
        `beam_search`) whose stream yields one finished output: the n best of best_of beams.
        """
        params = SamplingParams() if params is None else params
        if isinstance(params, SamplingParams) and params.use_beam_search:
            return await self._add_beam_search(request_id, prompt, params, lora_request, priority)
        (stream,) = await self._add_requests([(request_id, prompt, params, lora_request)], arrival_time,
                                             priority=priority)
        return stream

    async def _add_requests(self, requests: list[tuple[str, PromptType, SamplingParams, LoRARequest | None]],
                            arrival_time: float | None = None, beams_of: str | None = None,
                            priority: int = 0) -> list[RequestStream]:
        """Queues requests together and waits until the engine has accepted them all; if
        it refuses one, the others are aborted and its error is raised.

        beams_of: the caller's id of the beam search these requests are beams of. Beams are
        known by their engine ids alone, never by a caller's id: no caller's request can
        collide with them, and `abort` reaches them only through their search."""
        self._raise_if_dead()
        if beams_of is None:
            ids = [request_id for request_id, *_ in requests]
            taken = next((i for n, i in enumerate(ids) if self._is_running(i) or i in ids[:n]), None)
            if taken is not None:
                raise ValueError(f"request_id {taken!r} is already running.")
        loop = asyncio.get_running_loop()
        arrival_time = arrival_time or time.time()
        states, accepted = [], []
        for request_id, prompt, params, lora_request in requests:
            state = _RequestState(request_id, f"{request_id}@{next(self._add_counter)}", arrival_time,
                                  output_kind=params.output_kind, priority=priority)
            future = loop.create_future()
            if beams_of is None:
                self._requests[request_id] = state
            self._engine_requests[state.engine_request_id] = state
            self._pending_adds.append((state, prompt, params, lora_request, future))
            states.append(state)
            accepted.append(future)
        self._interrupt.set()
        self._start_loop()
        try:
            await asyncio.gather(*accepted)
        except BaseException:
            for future in accepted:
                if not future.done():  # cancelled, or still queued beside a refused one
                    future.cancel()
            for state in states:
                self._abort_state(state)
            raise
        return [RequestStream(self, state) for state in states]

    def _is_running(self, request_id: str) -> bool:
        return request_id in self._requests or request_id in self._beam_searches

    async def compile_structured_outputs(self, params: StructuredOutputsParams, timeout_s: float | None = None) -> None:
        """Waits, off the event loop, until the constraint's grammar is compiled (or found in
        the cache), so that a request with it starts at once. Raises StructuredOutputsError
        (a ValueError naming the request's field) if it does not compile, or is not compiled
        `timeout_s` seconds after it was first asked for; the compile itself goes on in its
        thread and the engine keeps stepping."""
        self._raise_if_dead()
        manager = self.engine.structured_output_manager
        if manager is None:
            raise ParameterError("structured outputs need a tokenizer; this engine runs with skip_tokenizer_init.",
                                 params.source)
        future = manager.compile(params)
        if not future.done():
            wrapped = asyncio.wrap_future(future)
            # Retrieved here, so a compile that fails after its waiter gave up is not logged
            # as an exception nobody saw.
            wrapped.add_done_callback(lambda done: done.cancelled() or done.exception())
            try:
                await asyncio.wait_for(asyncio.shield(wrapped), manager.remaining_s(params, timeout_s))
            except TimeoutError:
                raise manager.deadline_passed(params, timeout_s) from None
        future.result()

    async def generate(self, prompt: PromptType, sampling_params: SamplingParams | None,
                       request_id: str, lora_request: LoRARequest | None = None,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Yields the request's outputs as the engine produces them, the last one with
        `finished=True`. `sampling_params.output_kind` picks cumulative outputs
        (default), deltas, or only the final one. `lora_request` runs it under a LoRA
        adapter; `priority` as in `add_request`. Raises ValueError for a bad request."""
        stream = await self.add_request(request_id, prompt, sampling_params, lora_request=lora_request,
                                        priority=priority)
        try:
            async for output in stream:
                yield output
        finally:
            stream.close()

    async def encode(self, prompt: PromptType, pooling_params: PoolingParams | None,
                     request_id: str, priority: int = 0) -> AsyncIterator[PoolingRequestOutput]:
        """Yields the request's one output, its pooled vector (vLLM's AsyncLLM.encode); the
        engine must run runner='pooling'. `priority` as in `add_request`. Raises ValueError
        for a bad request."""
        stream = await self.add_request(request_id, prompt, pooling_params or PoolingParams(), priority=priority)
        try:
            async for output in stream:
                yield output
        finally:
            stream.close()

    # -------------------------------------------------------------- beam search
    async def beam_search(self, prompt: PromptType, request_id: str, params: BeamSearchParams,
                          lora_request: LoRARequest | None = None) -> BeamSearchOutput:
        """`LLM.beam_search` for one prompt (token ids, text or a prompt dict), on the
        running engine: each step's beams are one-token requests, added together, that run
        alongside everything else, under `lora_request`'s adapter if given.

        `request_id` is taken while the search runs, as a plain request's is: a second
        request of it raises ValueError. Cancelling the call, or `abort(request_id)`, aborts
        the beams; after an abort this raises asyncio.CancelledError and the id is free."""
        handle = self._register_beam_search(request_id)

        async def search() -> BeamSearchOutput:
            _, token_ids = await self._prompt_token_ids(prompt)
            driver = BeamSearchDriver([(token_ids, params)], self.engine.eos_token_ids, [cache_salt_of(prompt)],
                                      [lora_request])
            await run_async(driver, functools.partial(self._run_beam_step, request_id, driver))
            return driver.outputs(self.get_tokenizer())[0]

        handle.task = asyncio.get_running_loop().create_task(search(), name=f"beam-{request_id}")
        handle.task.add_done_callback(lambda _: self._unregister_beam_search(request_id, handle))
        try:
            return await handle.task  # cancelling this call cancels the search's task too
        except asyncio.CancelledError:
            if handle.aborted and not _current_task_cancelling():
                raise asyncio.CancelledError(f"Beam search {request_id!r} was aborted.") from None
            raise

    def _register_beam_search(self, request_id: str) -> _BeamSearchHandle:
        """Takes `request_id` for a beam search; ValueError if a request of it is running."""
        self._raise_if_dead()
        if self._is_running(request_id):
            raise ValueError(f"request_id {request_id!r} is already running.")
        handle = _BeamSearchHandle()
        self._beam_searches[request_id] = handle
        return handle

    def _unregister_beam_search(self, request_id: str, handle: _BeamSearchHandle) -> None:
        # A search aborted by its id no longer holds it: a new request may hold it now.
        if self._beam_searches.get(request_id) is handle:
            del self._beam_searches[request_id]

    async def _add_beam_search(self, request_id: str, prompt: PromptType, params: SamplingParams,
                               lora_request: LoRARequest | None = None, priority: int = 0) -> "_TaskStream":
        """`use_beam_search`: the search's first step is added before this returns, so a
        bad prompt raises here as for any request; the rest runs in a task that closing the
        stream, or `abort(request_id)`, cancels (aborting its beams)."""
        handle = self._register_beam_search(request_id)
        try:
            prompt_text, token_ids = await self._prompt_token_ids(prompt)
            token_ids = params.truncated_prompt(token_ids, self.model_config.max_model_len)
            max_tokens = params.max_tokens or self.model_config.max_model_len - len(token_ids)
            driver = BeamSearchDriver([(token_ids, beam_search_params_from(params, max_tokens))],
                                      self.engine.eos_token_ids, [cache_salt_of(prompt)], [lora_request])
            first_step = await self._add_beam_step(request_id, driver, driver.step_requests(), priority)
        except BaseException:
            self._unregister_beam_search(request_id, handle)
            raise

        async def search() -> RequestOutput:
            driver.advance(await _finals(first_step))
            await run_async(driver, functools.partial(self._run_beam_step, request_id, driver, priority=priority))
            (result,) = driver.outputs(self.get_tokenizer())
            return beam_search_request_output(request_id, prompt_text, token_ids, result, params.n)

        loop = asyncio.get_running_loop()
        if handle.aborted:  # aborted while its first step was added
            for stream in first_step:
                stream.close()
            aborted = loop.create_future()
            aborted.cancel()
            return _TaskStream(request_id, aborted)
        handle.task = loop.create_task(search(), name=f"beam-{request_id}")
        handle.task.add_done_callback(lambda _: self._unregister_beam_search(request_id, handle))
        return _TaskStream(request_id, handle.task)

    async def _prompt_token_ids(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(text, token ids) of a prompt; text is tokenized on the engine's thread."""
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        return await self._on_engine_thread(functools.partial(self.engine._tokenize_prompt, prompt))

    async def _add_beam_step(self, request_id: str, driver: BeamSearchDriver, requests: StepRequests,
                             priority: int = 0) -> list[RequestStream]:
        loras = driver.step_lora_requests()
        return await self._add_requests([(request_id, prompt, params, loras[i])
                                         for i, (prompt, params) in enumerate(requests)], beams_of=request_id,
                                        priority=priority)

    async def _run_beam_step(self, request_id: str, driver: BeamSearchDriver, requests: StepRequests,
                             priority: int = 0) -> list[RequestOutput]:
        return await _finals(await self._add_beam_step(request_id, driver, requests, priority))

    async def abort(self, request_id: str) -> None:
        """Stops a request; its blocks return to the pool before the next step.
        Its output stream ends without a finished output."""
        state = self._requests.get(request_id)
        if state is not None:
            self._abort_state(state)
        search = self._beam_searches.pop(request_id, None)
        if search is not None:
            search.abort()

    def _abort_state(self, state: _RequestState) -> None:
        """Ends this one incarnation of a request (never a later one that reuses its id)."""
        self._forget(state)
        if state.finished:
            return
        state.finished = True
        state.queue.put_nowait(_STREAM_END)
        self._pending_aborts.add(state.engine_request_id)
        self._interrupt.set()
        if self._wakeup is not None:
            self._wakeup.set()

    def _forget(self, state: _RequestState) -> None:
        if self._requests.get(state.request_id) is state:
            del self._requests[state.request_id]
        self._engine_requests.pop(state.engine_request_id, None)

    # --------------------------------------------------------------------- LoRA
    async def add_lora(self, lora_request: LoRARequest, allowed_dirs: Sequence[str] | None = None) -> bool:
        """Loads a LoRA adapter into the workers' host memory, on a thread of its own while
        the engine keeps stepping; raises ValueError (LoRAAdapterError) for an adapter the
        engine cannot serve. `allowed_dirs`: see LLMEngine.add_lora."""
        self._raise_if_dead()
        await asyncio.get_running_loop().run_in_executor(
            None, functools.partial(self.engine.add_lora, lora_request, allowed_dirs))
        return True

    async def remove_lora(self, lora_int_id: int) -> bool:
        """Forgets an adapter between two steps; its running requests finish with it."""
        return await self._on_engine_thread(functools.partial(self.engine.remove_lora, lora_int_id))

    async def list_loras(self) -> set[int]:
        return self.engine.list_loras()

    # --------------------------------------------------------------- sleep mode
    async def sleep(self, level: int = 1) -> None:
        """`LLM.sleep` between two steps: requests still running are aborted (vLLM's mode
        "abort"), each failing with EngineSleepingError; requests sent until `wake_up`
        fail with it too. Once called it completes, even if the caller is cancelled (a
        client that leaves /sleep): the requests it aborts are failed all the same (they
        waited forever)."""
        aborted_ids = asyncio.ensure_future(self._on_engine_thread(functools.partial(self.engine.sleep, level)))
        aborted_ids.add_done_callback(self._fail_requests_put_to_sleep)
        await asyncio.shield(aborted_ids)

    def _fail_requests_put_to_sleep(self, aborted_ids: asyncio.Future) -> None:
        from raylm.engine.engine_core import EngineSleepingError

        if aborted_ids.cancelled() or aborted_ids.exception() is not None:
            return
        for engine_request_id in aborted_ids.result():
            state = self._engine_requests.get(engine_request_id)
            if state is not None:
                self._fail_request(state, EngineSleepingError(
                    f"Request {state.request_id} was aborted: the engine was put to sleep."))

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """`LLM.wake_up` between two steps."""
        await self._on_engine_thread(functools.partial(self.engine.wake_up, tags))

    async def is_sleeping(self) -> bool:
        return self.engine.is_sleeping()

    async def reset_prefix_cache(self) -> bool:
        """Forgets the prefix cache between two steps; False while requests hold blocks."""
        return await self._on_engine_thread(self.engine.reset_prefix_cache)

    async def collective_rpc(self, method: Any, timeout: float | None = None, args: tuple = (),
                             kwargs: dict[str, Any] | None = None) -> list[Any]:
        """`LLM.collective_rpc` between two steps."""
        return await self._on_engine_thread(functools.partial(self.engine.collective_rpc, method, timeout, args,
                                                              kwargs))

    # ------------------------------------------------------------------- health
    async def check_health(self) -> None:
        """Raises AsyncEngineDeadError if the loop died, or the executor's error if a
        worker is gone."""
        self._raise_if_dead()
        await asyncio.get_running_loop().run_in_executor(None, self.engine.check_health)

    def _raise_if_dead(self) -> None:
        if self._dead_error is not None:
            raise AsyncEngineDeadError(f"The engine loop has stopped: {self._dead_error!r}") from self._dead_error
        if self._shutdown:
            raise AsyncEngineDeadError("The engine has been shut down.")

    def shutdown(self) -> None:
        """Stops the loop, fails the waiting requests and releases the workers."""
        if self._shutdown:
            return
        self._shutdown = True
        if self._loop_task is not None:
            self._loop_task.cancel()
        self._fail_all(AsyncEngineDeadError("The engine has been shut down."))
        self._thread_pool.shutdown(wait=False, cancel_futures=True)
        self.engine.shutdown()

    # --------------------------------------------------------------------- loop
    def _start_loop(self) -> None:
        if self._loop_task is None:
            self._wakeup = asyncio.Event()
            self._loop_task = asyncio.get_running_loop().create_task(self._run_loop(), name="raylm-engine-loop")
        self._wakeup.set()

    async def _run_loop(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                self._interrupt.clear()
                work = self._take_pending()
                if not work and not self.engine.has_unfinished_requests():
                    self._wakeup.clear()
                    if not self._has_pending():
                        await self._wakeup.wait()
                    continue
                if self.step_in_thread:
                    self._work_in_flight = work
                    await loop.run_in_executor(self._thread_pool, self._run_steps, loop, work)
                    self._work_in_flight = None
                else:
                    self._settle(self._apply(work))
                    if self.engine.has_unfinished_requests():
                        outputs = self.engine.step()
                        self._dispatch(outputs, self.engine.pop_failed_requests())
                    await asyncio.sleep(0)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - any failure of the loop kills the engine
            logger.exception("The engine loop died; failing all requests.")
            self._dead_error = exc
            self._fail_all(AsyncEngineDeadError(f"The engine loop has stopped: {exc!r}"))

    def _run_steps(self, loop: asyncio.AbstractEventLoop, work: "_PendingWork") -> None:
        """On the step thread: applies the queued aborts and adds (adding a request
        tokenizes it and fans out its n samples: an n=16384 request held the event loop
        0.84 s when that ran there), then steps back to back, handing each step's outputs
        to the event loop as it goes, until requests are to be added or aborted or none is
        left. Waiting for the loop between steps cost about 2 ms a step (a sixth of it)
        under 64 streams."""
        engine = self.engine
        settled = self._apply(work)
        if settled:
            # Before any output of these requests: callbacks run in the order they came.
            loop.call_soon_threadsafe(self._settle, settled)
        while not self._shutdown and engine.has_unfinished_requests():
            outputs = engine.step()
            failed = engine.pop_failed_requests()
            # At most a few steps ahead of the streams, so a busy loop slows the steps
            # instead of queueing outputs without bound.
            while not self._undelivered_steps.acquire(timeout=0.5):
                if self._shutdown or loop.is_closed():
                    return
            loop.call_soon_threadsafe(self._dispatch_step, outputs, failed)
            if self._interrupt.is_set():
                return

    def _dispatch_step(self, outputs: list[RequestOutput], failed: dict[str, BaseException]) -> None:
        try:
            self._dispatch(outputs, failed)
        finally:
            self._undelivered_steps.release()

    def _has_pending(self) -> bool:
        return bool(self._pending_adds or self._pending_aborts or self._pending_calls)

    def _take_pending(self) -> "_PendingWork":
        """On the event loop: what waits to be done on the engine, taken off the queues."""
        work = _PendingWork(self._pending_aborts, self._pending_adds, self._pending_calls)
        self._pending_aborts, self._pending_adds, self._pending_calls = set(), [], []
        return work

    def _apply(self, work: "_PendingWork") -> list[tuple[asyncio.Future, Any, BaseException | None]]:
        """On the engine's thread: aborts, adds and calls; returns each add's and call's
        (future, result, error) for `_settle` on the event loop."""
        if work.aborts:
            self.engine.abort_request(list(work.aborts))
        settled: list[tuple[asyncio.Future, Any, BaseException | None]] = []
        for state, prompt, params, lora_request, accepted in work.adds:
            if accepted.done() or state.finished:  # cancelled or aborted while queued
                continue
            try:
                self.engine.add_request(state.engine_request_id, prompt, params, state.arrival_time, lora_request,
                                        priority=state.priority)
            except Exception as exc:  # noqa: BLE001 - bad input fails this request only
                settled.append((accepted, None, exc))
                continue
            settled.append((accepted, None, None))
        for call, future in work.calls:
            try:
                settled.append((future, call(), None))
            except Exception as exc:  # noqa: BLE001 - handed to the caller
                settled.append((future, None, exc))
        return settled

    @staticmethod
    def _settle(settled: list[tuple[asyncio.Future, Any, BaseException | None]]) -> None:
        for future, result, error in settled:
            if future.done():  # the caller was cancelled meanwhile
                continue
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)

    async def _on_engine_thread(self, call: Callable[[], Any]) -> Any:
        """`call()` on the engine's thread, between steps (what touches the engine's
        tokenizer, which is never used from two threads at once)."""
        self._raise_if_dead()
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        self._pending_calls.append((call, future))
        self._interrupt.set()
        self._start_loop()
        return await future

    def _dispatch(self, outputs: list[RequestOutput], failed: dict[str, BaseException]) -> None:
        """Hands one step's outputs to their streams; `failed`: the requests the engine
        failed (and already aborted) in that step."""
        now = time.time()
        for output in outputs:
            # Outputs of an aborted request (stepped before the abort reached the engine)
            # find no state, even when a new request reuses its caller's id.
            state = self._engine_requests.get(output.request_id)
            if state is None or state.finished:
                continue
            output.request_id = state.request_id
            try:
                self._deliver(state, output, now)
            except Exception as exc:  # noqa: BLE001 - a bug in one request's output fails it alone
                logger.exception("Request %s failed while building its output.", output.request_id)
                self._fail_request(state, exc)
        # Requests the engine failed (and already aborted) during the step fail alone.
        for engine_request_id, exc in failed.items():
            state = self._engine_requests.get(engine_request_id)
            if state is not None:
                self._fail_request(state, exc)

    def _deliver(self, state: _RequestState, output: RequestOutput, now: float) -> None:
        # The engine's OutputProcessor already shaped the output for its kind.
        state.queue.put_nowait(output)
        if output.finished:
            state.finished = True
            self._forget(state)
            self._notify_finished(state, output, now)

    def _notify_finished(self, state: _RequestState, output: RequestOutput, now: float) -> None:
        if not self._stats_listeners:
            return
        metrics = output.metrics
        stats = FinishedRequestStats(
            request_id=state.request_id,
            finish_reasons=([c.finish_reason for c in output.outputs] if isinstance(output, RequestOutput)
                            else ["stop"]),
            num_prompt_tokens=len(output.prompt_token_ids),
            num_generation_tokens=metrics.num_generation_tokens if metrics else 0,
            arrival_time=state.arrival_time,
            first_token_time=metrics.first_token_time if metrics else None,
            finished_time=metrics.finished_time if metrics and metrics.finished_time else now,
        )
        for listener in self._stats_listeners:
            try:
                listener(stats)
            except Exception:  # noqa: BLE001 - metrics must never fail a request
                logger.exception("A stats listener failed.")

    def _fail_request(self, state: _RequestState, exc: BaseException) -> None:
        if not state.finished:
            state.finished = True
            state.queue.put_nowait(exc)
        self._forget(state)
        self._pending_aborts.add(state.engine_request_id)
        self._interrupt.set()

    def _fail_all(self, exc: BaseException) -> None:
        # Every state, beams (known by their engine ids alone) included.
        for state in list(self._engine_requests.values()):
            if not state.finished:
                state.finished = True
                state.queue.put_nowait(exc)
        self._requests.clear()
        self._engine_requests.clear()
        waiting = [work for work in (self._work_in_flight, self._take_pending()) if work is not None]
        futures = [accepted for work in waiting for *_, accepted in work.adds]
        futures += [future for work in waiting for _, future in work.calls]
        for future in futures:
            if not future.done():
                future.set_exception(exc)


def _merge_delta(older: RequestOutput, newer: RequestOutput) -> RequestOutput:
    """Two consecutive DELTA outputs of one request as one: each sample's new text,
    tokens and logprobs joined, the newer's finish state and metrics."""
    samples = {completion.index: completion for completion in older.outputs}
    for completion in newer.outputs:
        before = samples.get(completion.index)
        if before is None:
            samples[completion.index] = completion
            continue
        logprobs = None if before.logprobs is None and completion.logprobs is None else \
            list(before.logprobs or []) + list(completion.logprobs or [])
        samples[completion.index] = CompletionOutput(
            completion.index, before.text + completion.text, list(before.token_ids) + list(completion.token_ids),
            completion.cumulative_logprob, logprobs, completion.finish_reason, completion.stop_reason)
    return RequestOutput(newer.request_id, newer.prompt, newer.prompt_token_ids,
                         older.prompt_logprobs if older.prompt_logprobs is not None else newer.prompt_logprobs,
                         [samples[index] for index in sorted(samples)], newer.finished, newer.metrics)


def _step_thread_pool() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="raylm-engine-step")


async def _last(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
    """The final output of a stream (closing it aborts the request if it ends early)."""
    final = None
    try:
        async for output in stream:
            final = output
    finally:
        await stream.aclose()
    if final is None or not final.finished:
        raise AsyncEngineDeadError("A beam-search request ended without a final output.")
    return final


async def _finals(streams: list[RequestStream]) -> list[RequestOutput]:
    """The final outputs of a beam-search step's requests; whatever ends the wait
    (cancellation, an error), every one of them is closed, which aborts those unfinished."""
    try:
        return list(await asyncio.gather(*(_last(stream) for stream in streams)))
    finally:
        for stream in streams:
            stream.close()


def _current_task_cancelling() -> bool:
    """Whether the task running now is being cancelled (not only a task it awaits)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


class _TaskStream:
    """A stream whose one output is a task's result (a beam search's): closing it,
    dropping it or cancelling its reader cancels the task."""

    def __init__(self, request_id: str, task: asyncio.Future) -> None:
        self.request_id = request_id
        self._task = task
        self._loop = task.get_loop()
        self._done = False

    def __aiter__(self) -> "_TaskStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        try:
            return await self._task  # a reader cancelled here cancels the task too
        except asyncio.CancelledError:
            if self._task.cancelled() and not _current_task_cancelling():
                raise StopAsyncIteration from None  # aborted: the stream ends, as any request's
            raise
        finally:
            self._done = True

    def close(self) -> None:
        self._done = True
        self._task.cancel()

    async def aclose(self) -> None:
        self.close()

    def __del__(self) -> None:
        if not self._task.done():
            try:
                self._loop.call_soon_threadsafe(self._task.cancel)
            except RuntimeError:  # the loop is closed
                pass

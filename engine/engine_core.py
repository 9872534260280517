"""`EngineCore`: the scheduler, the KV-cache manager and the executor, stepping tokens.

It knows token ids only: each `step()` schedules a batch, runs it on the workers, appends
the sampled tokens, applies the token-level stops (EOS ids, stop token ids, max_tokens,
max_model_len, min_tokens) and frees the blocks of the requests that finished. Text, stop
strings and the shape of outputs belong to the `OutputProcessor`.

With speculative decoding a request's step can yield several tokens (its accepted
proposals and the target's own): only those are appended, checked for stops one by one,
and the KV slots of the rejected proposals are given back (`_roll_back_rejected`).
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from raylm.engine.config import EngineConfig, kv_cache_block_bytes, max_blocks_per_request
from raylm.engine.lora_loader import LoRALoader
from raylm.engine.lora_slots import LoRASlots
from raylm.engine.output_processor import EngineCoreOutput
from raylm.engine.pipeline_schedule import steps_in_flight
from raylm.engine.request import Request, RequestStatus
from raylm.engine.sampling_params import ParameterError
from raylm.engine.scheduler import Scheduler, SchedulerOutput
from raylm.engine.stat_logger import StatLogger
from raylm.engine.step import SampledToken, SamplerOutput
from raylm.executors.executor_base import SLEEP_TAGS

if TYPE_CHECKING:
    from raylm.engine.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)

class EngineSleepingError(RuntimeError):
    """A request reached an engine put to sleep (LLM.sleep): it must be woken up first.
    The server answers it with 503."""


# How long a step with nothing to run waits for an adapter load to end.
_LORA_LOAD_WAIT_S = 0.05


@dataclass
class _StepInFlight:
    """A batch handed to the executor whose output has not been applied yet."""

    scheduler_output: SchedulerOutput
    wait: Callable[[], SamplerOutput]
    start: float


class EngineCore:
    def __init__(self, engine_config: EngineConfig, eos_token_ids: Iterable[int] = (),
                 log_stats: bool = True, structured_output_manager: StructuredOutputManager | None = None) -> None:
        self.engine_config = engine_config
        self.max_model_len = engine_config.model_config.max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        start = time.perf_counter()
        self.executor = _executor_class(engine_config)(engine_config)
        logger.info("Workers ready, model loaded in %.1f s.", time.perf_counter() - start)
        # The workers run from here on: a failure before the engine is whole (a KV cache too
        # small, a compiled graph that does not build, an interrupt) must end them, or
        # they live on, held by the traceback, until the garbage collector frees it.
        self.lora_loader = None
        try:
            self._finish_init(engine_config, structured_output_manager, log_stats)
        except BaseException:
            self.shutdown()
            raise

    def _finish_init(self, engine_config: EngineConfig, structured_output_manager: StructuredOutputManager | None,
                     log_stats: bool) -> None:
        start = time.perf_counter()
        self._initialize_kv_caches()
        logger.info("KV cache allocated and model warmed up in %.1f s.", time.perf_counter() - start)
        self.lora_loader, lora_slots = self._lora_state(engine_config)
        self.structured_output_manager = structured_output_manager
        self.scheduler = Scheduler(engine_config.scheduler_config, engine_config.cache_config,
                                   speculative_config=engine_config.speculative_config,
                                   structured_output_manager=structured_output_manager, lora_slots=lora_slots,
                                   sends_all_context=bool(engine_config.model_config.logits_processors))
        # Requests the core ended on an error (a grammar that did not compile, a token the
        # grammar refused), with the error, until pop_failed_requests() takes them.
        self._failed_requests: dict[str, BaseException] = {}
        self.stat_logger = StatLogger(self.scheduler) if log_stats else None
        self.num_generation_tokens_total = 0
        # Batches handed to the executor, oldest first: at most one, or two with async
        # scheduling (the next is scheduled while the workers run the previous), or under
        # pipeline parallel one micro-batch per stage and one more (`pipeline_schedule.py`).
        self._in_flight: deque[_StepInFlight] = deque()
        # Nothing to overlap when the worker runs in this thread.
        self.async_scheduling = (engine_config.scheduler_config.async_scheduling
                                 and self.executor.runs_steps_asynchronously)
        self.max_steps_in_flight = steps_in_flight(engine_config.scheduler_config,
                                                   self.executor.runs_steps_asynchronously)
        if self.scheduler.drafter is not None:
            self.scheduler.drafter.misses_count_as_rejections = self.async_scheduling
        if engine_config.model_config.is_pooling:
            # Chosen once: the generating engine's per-step path stays as it is.
            self._update_from_output = self._update_from_pooling_output

    def _lora_state(self, engine_config: EngineConfig) -> tuple[LoRALoader | None, LoRASlots | None]:
        """enable_lora: the adapters in the workers' host memory and their slots."""
        lora_config = engine_config.lora_config
        if lora_config is None:
            return None, None
        loader = LoRALoader(lora_config, engine_config.model_config.hf_config, self.executor)
        slots = LoRASlots(lora_config.max_loras, loader)
        loader.in_use = slots.in_use
        return loader, slots

    def _initialize_kv_caches(self) -> None:
        cache_config = self.engine_config.cache_config
        num_blocks = self.executor.determine_num_available_blocks()
        if cache_config.num_gpu_blocks_override is not None:
            num_blocks = cache_config.num_gpu_blocks_override
        # A request must fit the pool alone (the scheduler's progress guarantee): its whole
        # context, or with a sliding window on every layer, its window and one step's tokens.
        needed = max_blocks_per_request(self.max_model_len, cache_config.block_size, cache_config.sliding_window,
                                        self.engine_config.scheduler_config.max_num_batched_tokens)
        if num_blocks < needed:
            raise ValueError(
                f"The KV cache holds {num_blocks} blocks of {cache_config.block_size} tokens "
                f"({num_blocks * cache_config.block_size} tokens), fewer than the {needed} blocks one request of "
                f"max_model_len ({self.max_model_len}) tokens can hold at once: it would not fit. Give the cache "
                f"more memory or lower max_model_len.")
        cache_config.num_gpu_blocks = num_blocks
        self.executor.initialize_cache(num_blocks)
        parallel_config = self.engine_config.parallel_config
        # Per worker of the stage holding the most layers (every layer without a pipeline).
        num_layers = -(-self.engine_config.model_config.num_layers // parallel_config.pipeline_parallel_size)
        block_bytes = kv_cache_block_bytes(self.engine_config.model_config, cache_config.block_size,
                                           parallel_config.tensor_parallel_size, num_layers, cache_config.cache_dtype)
        logger.info("KV cache: %d blocks of %d tokens (%.0f MiB per worker); %.2fx max_model_len (%d tokens) "
                    "fits at once; prefix caching %s, chunked prefill %s.", num_blocks, cache_config.block_size,
                    num_blocks * block_bytes / 2**20, num_blocks * cache_config.block_size / self.max_model_len,
                    self.max_model_len, "on" if cache_config.enable_prefix_caching else "off",
                    "on" if self.engine_config.scheduler_config.enable_chunked_prefill else "off")

    # ---------------------------------------------------------------- requests
    def add_request(self, request: Request) -> None:
        structured = request.sampling_params.structured_outputs
        if structured is not None:
            # Compiles (or finds) its grammar off the step; it waits until that is done.
            request.structured_output_request = self.structured_output_manager.new_request(
                structured, request.sampling_params.allowed_token_ids)
            request.status = RequestStatus.WAITING_FOR_FSM
        self.scheduler.add_request(request)

    def pop_failed_requests(self) -> dict[str, BaseException]:
        """The requests ended on an error since the last call (already freed), with the errors."""
        failed = self._failed_requests
        failed.update(self.scheduler.failed_requests)
        self.scheduler.failed_requests = {}
        self._failed_requests = {}
        return failed

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Stops the requests and frees their blocks at once; unknown ids are skipped."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        if self.stat_logger is not None and not self.scheduler.has_unfinished_requests():
            self.stat_logger.flush()

    def stop_requests(self, request_ids: Iterable[str]) -> None:
        """Ends requests that a stop string finished (found by the output processor)."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_STOPPED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # -------------------------------------------------------------------- step
    def step(self) -> list[EngineCoreOutput]:
        """Runs one batch; returns one output per request that gained tokens, prompt
        logprobs or a finish."""
        self.start_step()
        return self.finish_step()

    @property
    def runs_steps_asynchronously(self) -> bool:
        """Whether start_step returns while the workers still run the batch."""
        return self.executor.runs_steps_asynchronously

    def has_step_in_flight(self) -> bool:
        return bool(self._in_flight)

    @property
    def num_steps_in_flight(self) -> int:
        return len(self._in_flight)

    def start_step(self) -> bool:
        """Schedules a batch and hands it to the executor; False when there is nothing to
        run. With workers in other processes it returns while they run it: requests may be
        added, aborted or stopped meanwhile (a request ended while its batch runs has that
        batch's token dropped). With async scheduling one more batch may start before the
        first is collected: its decodes compute the tokens the first samples."""
        assert len(self._in_flight) < self.max_steps_in_flight, "finish_step must collect a batch in flight first"
        step_start = time.monotonic()
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty():
            if self.lora_loader is not None and not self._in_flight:
                # Requests may be waiting for their adapter: wait for the load, not in a busy loop.
                self.lora_loader.wait_for_progress(_LORA_LOAD_WAIT_S)
            self._wait_for_grammars()
            return False
        wait = self.executor.execute_model_async(scheduler_output.step)
        self._in_flight.append(_StepInFlight(scheduler_output, wait, step_start))
        return True

    def _wait_for_grammars(self, timeout_s: float = 0.01) -> None:
        """With nothing to run but requests whose grammars compile, waits a little for one
        rather than have the caller spin on empty steps."""
        if self._in_flight or self.structured_output_manager is None:
            return
        compiling = [r.structured_output_request.grammar for r in self.scheduler.waiting
                     if r.status == RequestStatus.WAITING_FOR_FSM]
        if compiling:
            concurrent.futures.wait(compiling, timeout_s, return_when=concurrent.futures.FIRST_COMPLETED)

    def finish_step(self) -> list[EngineCoreOutput]:
        """Waits for the oldest batch in flight and applies its tokens and stops; [] if none."""
        if not self._in_flight:
            return []
        in_flight = self._in_flight.popleft()
        sampler_output = in_flight.wait()
        outputs = self._update_from_output(in_flight.scheduler_output, sampler_output)
        num_generated = sum(len(output.new_token_ids) for output in outputs)
        self.num_generation_tokens_total += num_generated
        if self.stat_logger is not None:
            self.stat_logger.record_step(in_flight.scheduler_output, num_generated, in_flight.start)
            if not self.scheduler.has_unfinished_requests():
                self.stat_logger.flush()
        return outputs

    def _update_from_output(self, scheduler_output: SchedulerOutput,
                            sampler_output: SamplerOutput) -> list[EngineCoreOutput]:
        if sampler_output.lora_failures:
            self._fail_requests_of_unreadable_loras(sampler_output.lora_failures)
        sampled = _tokens_by_request(sampler_output.outputs)
        request_errors = sampler_output.request_errors
        prompt_logprobs = sampler_output.prompt_logprobs
        outputs: list[EngineCoreOutput] = []
        finished: list[Request] = []
        finished_while_preempted = False
        for request, scheduled in zip(scheduler_output.scheduled, scheduler_output.step.requests):
            if scheduled.do_sample:
                request.num_output_placeholders -= 1
            tokens = sampled.get(request.worker_id)
            if scheduled.spec_token_ids:
                self._roll_back_rejected(request, len(scheduled.spec_token_ids), len(tokens) - 1 if tokens else 0)
            if request.is_finished:
                continue  # aborted or stopped by a stop string while its batch ran
            new_prompt_logprobs = prompt_logprobs.get(request.worker_id) if prompt_logprobs else None
            if tokens is None and new_prompt_logprobs is None:
                continue  # a prefill chunk short of the prompt's end
            # Positional (one call per request a step: keywords cost twice as much).
            output = EngineCoreOutput(request.request_id, [], [], None, new_prompt_logprobs, None, None,
                                      request.num_cached_tokens)
            was_preempted = request.status == RequestStatus.PREEMPTED
            structured = request.structured_output_request
            failed = False
            for token in tokens or ():
                error = None
                if request_errors and request.worker_id in request_errors:
                    error = RuntimeError(request_errors[request.worker_id])
                elif token.logits_not_finite:
                    error = _not_finite_error(request)
                elif structured is not None and not structured.accept_token(token.token_id):
                    # The bitmask allows only what the grammar accepts, unless the grammar came
                    # to a dead end (it allows nothing, and EOS was let through): the request
                    # fails rather than go on with an output that no longer matches.
                    error = _grammar_error(request, token.token_id)
                if error is not None:
                    request.status = RequestStatus.FINISHED_ABORTED
                    self._failed_requests[request.request_id] = error
                    finished_while_preempted |= was_preempted
                    finished.append(request)
                    failed = True
                    break
                request.append_output_token(token.token_id)
                output.new_token_ids.append(token.token_id)
                output.new_token_logprobs.append(token.logprob)
                if token.logprobs is not None:
                    if output.new_logprobs is None:
                        output.new_logprobs = []
                    output.new_logprobs.append(token.logprobs)
                if self._check_stop(request, token.token_id):
                    # Accepted tokens after a stop are dropped, as plain decoding never made them.
                    finished_while_preempted |= was_preempted
                    output.finish_reason = RequestStatus.get_finished_reason(request.status)
                    output.stop_reason = request.stop_reason
                    finished.append(request)
                    break
            if not failed:
                outputs.append(output)
        self.scheduler.free_finished(finished, preempted=finished_while_preempted)
        return outputs

    def _update_from_pooling_output(self, scheduler_output: SchedulerOutput,
                                    sampler_output: SamplerOutput) -> list[EngineCoreOutput]:
        """A pooling engine's step: each request whose prompt ended in it gets its pooled
        vector and finishes ("stop"); its blocks go back to the pool (full ones stay cached
        for later prompts with the same prefix). Earlier chunks produce nothing, but those
        of a request that pools every token, whose rows are kept until its last chunk."""
        pooled = sampler_output.pooler_output or {}
        outputs: list[EngineCoreOutput] = []
        finished: list[Request] = []
        finished_while_preempted = False
        for request, scheduled in zip(scheduler_output.scheduled, scheduler_output.step.requests):
            if scheduled.pools_every_token and not request.is_finished:
                _keep_token_rows(request, scheduled.num_computed_tokens, pooled[request.worker_id])
            if not scheduled.do_sample:
                continue  # a prompt chunk short of the prompt's end
            request.num_output_placeholders -= 1
            if request.is_finished:
                continue  # aborted while its step ran
            finished_while_preempted |= request.status == RequestStatus.PREEMPTED
            request.status = RequestStatus.FINISHED_STOPPED
            finished.append(request)
            output = _token_rows(request) if scheduled.pools_every_token else pooled[request.worker_id]
            outputs.append(EngineCoreOutput(request.request_id, [], [], finish_reason="stop",
                                            num_cached_tokens=request.num_cached_tokens, pooling_output=output))
        self.scheduler.free_finished(finished, preempted=finished_while_preempted)
        return outputs

    def _roll_back_rejected(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """After a verification: counts it, and for a request still running takes back the
        rejected proposals, which the scheduler counted as computed, and the blocks that held
        only them. (A preempted or finished request holds no blocks any more.)"""
        request.spec_token_ids = []
        drafter = self.scheduler.drafter
        if drafter is not None:
            drafter.record(request, num_drafts, num_accepted)
        if request.status != RequestStatus.RUNNING:
            return
        request.num_computed_tokens -= num_drafts - num_accepted
        self.scheduler.kv_cache_manager.free_blocks_beyond(request, request.num_computed_tokens)

    def _check_stop(self, request: Request, token_id: int) -> bool:
        """vLLM's stop rules, in order: min_tokens holds back everything but length; then
        EOS, stop token ids, and the two length limits. Sets the request's status."""
        params = request.sampling_params
        num_output_tokens = len(request.output_token_ids)
        # all_stop_token_ids: the EOS ids (unless ignore_eos) and stop_token_ids, one set.
        if token_id in params.all_stop_token_ids and num_output_tokens >= params.min_tokens:
            request.status = RequestStatus.FINISHED_STOPPED
            is_eos = token_id in self.eos_token_ids and not params.ignore_eos
            request.stop_reason = None if is_eos else token_id
            return True
        if num_output_tokens >= params.max_tokens or len(request.all_token_ids) >= self.max_model_len:
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        structured = request.structured_output_request
        if structured is not None and structured.is_terminated_by(token_id):
            # The grammar took its stop token (EOS) while the request goes on past EOS
            # (ignore_eos, min_tokens): nothing more may follow.
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = None
            return True
        return False

    # -------------------------------------------------------------------- LoRA
    def fail_requests_of_failed_loras(self) -> dict[str, BaseException]:
        """Ends the waiting requests of adapters whose load failed; returns their ids with the
        error."""
        if self.lora_loader is None:
            return {}
        failures = self.lora_loader.take_failures()
        if not failures:
            return {}
        failed = {request.request_id: failures[request.lora_request.lora_int_id]
                  for request in self.scheduler.waiting
                  if request.lora_request is not None and request.lora_request.lora_int_id in failures}
        self.scheduler.finish_requests(list(failed), RequestStatus.FINISHED_ABORTED)
        return failed

    def _fail_requests_of_unreadable_loras(self, failures: dict[tuple[int, Any], tuple[str, str]]) -> None:
        """A step could not put these adapters in their slots (a worker had to read one again,
        and its files were gone or changed): every request of theirs fails with the error,
        running or waiting (the slot ran empty, so a running one's tokens are not its
        adapter's); their blocks and slots are freed, and their blocks leave the prefix cache
        (the step registered them under the adapter's key but computed them without it). The
        batch and the engine go on."""
        from raylm.executors.lora_adapter import lora_error_from_worker

        # By id and digest: requests of the same id under the files of an earlier add (the
        # adapter removed and added again) hold another slot, filled then, and go on.
        errors = {adapter: lora_error_from_worker(*failure) for adapter, failure in failures.items()}
        doomed = {request.request_id: errors[request.lora_request.lora_int_id, request.lora_digest]
                  for request in self.scheduler.requests.values()
                  if request.lora_request is not None
                  and (request.lora_request.lora_int_id, request.lora_digest) in errors}
        kv_cache_manager = self.scheduler.kv_cache_manager
        for request in self.scheduler.finish_requests(list(doomed), RequestStatus.FINISHED_ABORTED):
            kv_cache_manager.evict_cached_blocks(request)
        self._failed_requests.update(doomed)
        for (lora_int_id, digest), error in errors.items():
            logger.warning("LoRA adapter %d could not be read into its slot; %d of its requests fail: %s",
                           lora_int_id, sum(e is error for e in doomed.values()), error)
            self.scheduler.lora_slots.forget(lora_int_id)
            self.lora_loader.unreadable(lora_int_id, digest)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forgets an adapter (requests already running under it finish with it)."""
        if self.lora_loader is None:
            return False
        self.scheduler.lora_slots.forget(lora_int_id)
        return self.lora_loader.remove(lora_int_id)

    # -------------------------------------------------------------- sleep mode
    def sleep(self, level: int = 1) -> None:
        """vLLM's sleep (mode "abort"): aborts every unfinished request (the caller tells
        their callers), waits for the batches in flight, resets the prefix cache (its
        blocks' KV is about to be freed) and has the workers free their memory. Needs
        enable_sleep_mode."""
        self.check_sleep_level(level)
        self.abort_requests(list(self.scheduler.requests))
        while self._in_flight:
            self.finish_step()  # its requests are aborted: their tokens are dropped
        if not self.scheduler.kv_cache_manager.reset_prefix_cache():
            raise RuntimeError("The prefix cache could not be reset: blocks are still held after every request "
                               "was aborted.")
        self.executor.sleep(level)

    def check_sleep_level(self, level: int) -> None:
        """Raises ValueError unless sleep mode is on and `level` is 1 or 2."""
        self._check_sleep_mode()
        if level not in (1, 2) or isinstance(level, bool):
            raise ParameterError(f"sleep level must be 1 (offload the weights, free the KV cache) or 2 (discard the "
                                 f"weights too), got {level!r}.", "level")

    def _check_sleep_mode(self) -> None:
        if not self.engine_config.model_config.enable_sleep_mode:
            raise ValueError("Sleep mode is not enabled: start the engine with enable_sleep_mode=True "
                             "(--enable-sleep-mode) to use sleep and wake_up.")

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restores the memory of `tags` ("weights", "kv_cache"; None: both)."""
        self._check_sleep_mode()
        if tags is not None:
            tags = [tags] if isinstance(tags, str) else list(tags)
            unknown = [tag for tag in tags if tag not in SLEEP_TAGS]
            if unknown:
                raise ParameterError(f"wake_up tags must be among {list(SLEEP_TAGS)}, got {unknown}.", "tags")
        self.executor.wake_up(tags)

    def is_sleeping(self) -> bool:
        """True until every memory tag put to sleep is woken up (vLLM's)."""
        return self.executor.is_sleeping

    def check_awake(self) -> None:
        if self.executor.is_sleeping:
            raise EngineSleepingError(f"The engine is asleep ({', '.join(sorted(self.executor.sleeping_tags))} "
                                      f"freed): wake it up (LLM.wake_up, or POST /wake_up) before sending requests.")

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached block (vLLM's); False while requests hold blocks."""
        return self.scheduler.kv_cache_manager.reset_prefix_cache()

    # --------------------------------------------------------------- lifecycle
    def check_health(self) -> None:
        self.executor.check_health()

    def shutdown(self) -> None:
        if self.lora_loader is not None:
            self.lora_loader.shutdown()
        self.executor.shutdown()


def _not_finite_error(request: Request) -> Exception:
    adapter = f" under the LoRA adapter {request.lora_request.lora_name!r}" if request.lora_request else ""
    return RuntimeError(f"The model's logits{adapter} held NaN or infinite values at output token "
                        f"{request.num_output_tokens}: its weights overflow in this dtype. The request was ended; "
                        f"the engine serves on.")


def _grammar_error(request: Request, token_id: int) -> Exception:
    structured = request.structured_output_request
    if structured.dead_end == "allowed_token_ids":
        return ParameterError(f"allowed_token_ids: none of them is a token that {structured.params.source} allows "
                              f"after the request's {request.num_output_tokens} output tokens (an output the grammar "
                              f"completes ends with an EOS token, which allowed_token_ids must then hold): it cannot "
                              f"be completed.", "allowed_token_ids")
    if structured.dead_end == "grammar":
        return ParameterError(f"{structured.params.source}: the request's grammar allows no token after its "
                              f"{request.num_output_tokens} output tokens: it cannot be completed.",
                              structured.params.source)
    return RuntimeError(f"Token {token_id} was sampled although the request's grammar does not allow it.")


def _tokens_by_request(outputs: list[SampledToken]) -> dict[int, list[SampledToken]]:
    """The step's tokens of each request, in order (several after a verification)."""
    by_request = {token.req_id: [token] for token in outputs}
    if len(by_request) == len(outputs):
        return by_request  # one token each: no verification in the step
    by_request = {}
    for token in outputs:
        tokens = by_request.get(token.req_id)
        if tokens is None:
            by_request[token.req_id] = [token]
        else:
            tokens.append(token)
    return by_request


def _executor_class(engine_config: EngineConfig) -> type:
    if engine_config.parallel_config.use_ray:
        from raylm.executors.ray_distributed_executor import RayDistributedExecutor

        return RayDistributedExecutor
    if engine_config.parallel_config.world_size > 1:
        raise ValueError("tensor_parallel_size or pipeline_parallel_size > 1 needs the Ray executor "
                         "(distributed_executor_backend='ray').")
    from raylm.executors.uniproc_executor import UniProcExecutor

    return UniProcExecutor


def _keep_token_rows(request: Request, start: int, rows: Any) -> None:
    """Keeps a chunk's rows (those of positions start ...) of a request that pools every
    token, in place of any kept from there on (its chunks computed again after a preemption)."""
    request.pooled_token_rows = [kept for kept in request.pooled_token_rows if kept[0] < start]
    request.pooled_token_rows.append((start, rows))


def _token_rows(request: Request) -> Any:
    """The rows of every prompt token of a request that pools every token, in order."""
    import torch

    rows = torch.cat([chunk for _, chunk in request.pooled_token_rows])
    request.pooled_token_rows = []
    assert len(rows) == request.num_prompt_tokens, (len(rows), request.num_prompt_tokens)
    return rows

"""`LLMEngine`: takes requests, steps the scheduler and the executor, returns outputs."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterable
from typing import Any

from raylm.engine.arg_utils import EngineArgs
from raylm.engine.config import EngineConfig
from raylm.engine.detokenizer import IncrementalDetokenizer, TokenTextCache, find_stop_string
from raylm.engine.outputs import CompletionOutput, Logprob, RequestOutput
from raylm.engine.sampling_params import RequestOutputKind, SamplingParams
from raylm.engine.scheduler import Scheduler
from raylm.engine.sequence import Sequence, SequenceGroup, SequenceStatus
from raylm.engine.stat_logger import StatLogger
from raylm.engine.step import SamplerOutput, SequenceOutput, TokenLogprobs
from raylm.engine.tokenizer import get_tokenizer

logger = logging.getLogger(__name__)

# A prompt: text, token ids, or vLLM's dict forms {"prompt": str} / {"prompt_token_ids": [...]}.
PromptType = str | list[int] | dict[str, Any]


class LLMEngine:
    """Runs requests to completion, one `step()` at a time.

    Each step schedules a batch (continuous batching: requests join and leave at any
    step), runs it on the executor's workers, appends the sampled tokens, detokenizes
    them, applies the stop conditions and frees the blocks of finished sequences.
    """

    def __init__(self, engine_config: EngineConfig, log_stats: bool = True) -> None:
        self.engine_config = engine_config
        self.model_config = engine_config.model_config
        self.tokenizer = None if self.model_config.skip_tokenizer_init else get_tokenizer(
            self.model_config.tokenizer, self.model_config.trust_remote_code, self.model_config.revision,
            self.model_config.tokenizer_mode)
        self.eos_token_id = self._find_eos_token_id()
        self.executor = _executor_class(engine_config)(engine_config)
        self._initialize_kv_caches()
        self.scheduler = Scheduler(engine_config.scheduler_config, engine_config.cache_config)
        self._seq_counter = itertools.count()
        self._seqs: dict[int, tuple[Sequence, SequenceGroup]] = {}
        # Unfinished requests by id: a set lookup, not a scan of the queues, per add_request.
        self._request_ids: set[str] = set()
        # Requests that failed inside the engine (a detokenizer error): aborted at the end of
        # the step, reported through pop_failed_requests(); the rest of the batch goes on.
        self._failed_requests: dict[str, BaseException] = {}
        self._detokenizers: dict[int, IncrementalDetokenizer] = {}
        self._token_text = TokenTextCache(self.tokenizer) if self.tokenizer is not None else None
        self.stat_logger = StatLogger(self.scheduler) if log_stats else None

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> "LLMEngine":
        return cls(engine_args.create_engine_config(), log_stats=not engine_args.disable_log_stats)

    # ----------------------------------------------------------------- set-up
    def _find_eos_token_id(self) -> int | None:
        eos = getattr(self.model_config.hf_config, "eos_token_id", None)
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        if eos is None and self.tokenizer is not None:
            eos = self.tokenizer.eos_token_id
        return eos

    def _initialize_kv_caches(self) -> None:
        cache_config = self.engine_config.cache_config
        num_blocks = self.executor.determine_num_available_blocks()
        if cache_config.num_gpu_blocks_override is not None:
            num_blocks = cache_config.num_gpu_blocks_override
        max_model_len = self.model_config.max_model_len
        if num_blocks * cache_config.block_size < max_model_len:
            raise ValueError(
                f"The KV cache holds {num_blocks} blocks of {cache_config.block_size} tokens "
                f"({num_blocks * cache_config.block_size} tokens), fewer than max_model_len ({max_model_len}): "
                f"one full-length sequence would not fit. Give the cache more memory or lower max_model_len.")
        cache_config.num_gpu_blocks = num_blocks
        self.executor.initialize_cache(num_blocks)
        logger.info("KV cache: %d blocks of %d tokens; %.2fx max_model_len (%d tokens) fits at once.",
                    num_blocks, cache_config.block_size, num_blocks * cache_config.block_size / max_model_len,
                    max_model_len)

    # --------------------------------------------------------------- requests
    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> None:
        """Validates a request and queues it; raises ValueError for bad input."""
        params = SamplingParams() if params is None else params
        if request_id in self._request_ids:
            raise ValueError(f"request_id {request_id!r} is already running.")
        prompt_text, prompt_token_ids = self._tokenize_prompt(prompt)
        self._validate_request(prompt_token_ids, params)
        params = self._with_engine_defaults(params, len(prompt_token_ids))
        block_size = self.engine_config.cache_config.block_size
        seqs = [Sequence(next(self._seq_counter), prompt_text, prompt_token_ids, block_size)
                for _ in range(params.best_of)]
        group = SequenceGroup(request_id, seqs, params, arrival_time or time.time(), prompt_text,
                              prompt_token_ids)
        for seq in seqs:
            self._seqs[seq.seq_id] = (seq, group)
            if self.tokenizer is not None:
                self._detokenizers[seq.seq_id] = IncrementalDetokenizer(
                    self.tokenizer, prompt_token_ids, params.skip_special_tokens,
                    params.spaces_between_special_tokens)
        self.scheduler.add_seq_group(group)
        self._request_ids.add(request_id)

    def _tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" not in prompt:
                raise ValueError("A prompt dict needs a 'prompt' (text) or 'prompt_token_ids' key.")
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("Text prompts need a tokenizer; this engine runs with skip_tokenizer_init.")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise ValueError(f"A prompt must be a string, a list of token ids or a dict; got {type(prompt).__name__}.")

    def _validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        max_model_len = self.model_config.max_model_len
        vocab_size = self.model_config.vocab_size
        if not prompt_token_ids:
            raise ValueError("The prompt is empty: it must have at least one token.")
        if len(prompt_token_ids) > max_model_len:
            raise ValueError(f"The prompt is {len(prompt_token_ids)} tokens long, more than the model's "
                             f"context length (max_model_len = {max_model_len}).")
        bad = next((t for t in prompt_token_ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ValueError(f"Prompt token id {bad} is outside the vocabulary [0, {vocab_size}).")
        params.verify_vocab(vocab_size)
        if params.logprobs is not None and params.logprobs > vocab_size:
            raise ValueError(f"logprobs must be at most the vocabulary size {vocab_size}, got {params.logprobs}.")

    def _with_engine_defaults(self, params: SamplingParams, prompt_len: int) -> SamplingParams:
        """Fills what depends on the model: the tokens min_tokens holds back, max_tokens=None."""
        stop_ids = set(params.stop_token_ids)
        if self.eos_token_id is not None and not params.ignore_eos:
            stop_ids.add(self.eos_token_id)
        params.all_stop_token_ids = stop_ids
        if params.max_tokens is None:
            params.max_tokens = self.model_config.max_model_len - prompt_len
        return params

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Stops requests; their blocks go back to the pool at once."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for group in self.scheduler.abort_seq_group(ids):
            self._forget_group(group)

    def pop_failed_requests(self) -> dict[str, BaseException]:
        """Requests that failed inside the engine since the last call, with their errors.
        They are already aborted: their blocks are back in the pool."""
        failed, self._failed_requests = self._failed_requests, {}
        return failed

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_seqs()

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.get_num_unfinished_seq_groups()

    # ------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Runs one batch and returns the outputs of the requests it advanced."""
        request, sched_out = self.scheduler.schedule()
        now = time.time()
        outputs = [self._make_output(group, now) for group in sched_out.ignored_seq_groups]
        for group in sched_out.ignored_seq_groups:
            self._forget_group(group)
        if not request.seqs:
            return [o for o in outputs if o is not None]
        sampler_output: SamplerOutput = self.executor.execute_model(request)
        now = time.time()
        self._apply_prompt_logprobs(sampler_output)
        for seq_output in sampler_output.outputs:
            self._append_token(seq_output)
        for group in sched_out.scheduled_seq_groups:
            if group.metrics.first_token_time is None and group.num_output_tokens() > 0:
                group.metrics.first_token_time = now
            output = self._make_output(group, now)
            if output is not None:
                outputs.append(output)
        for group in self.scheduler.free_finished_seq_groups():
            self._forget_group(group)
        if self._failed_requests:
            self.abort_request(list(self._failed_requests))
            outputs = [o for o in outputs if o.request_id not in self._failed_requests]
        if self.stat_logger is not None:
            self.stat_logger.record_step(sched_out, len(sampler_output.outputs))
        return outputs

    def _apply_prompt_logprobs(self, sampler_output: SamplerOutput) -> None:
        for seq_id, entries in sampler_output.prompt_logprobs.items():
            _, group = self._seqs[seq_id]
            group.prompt_logprobs = [None] + [self._to_logprob_dict(e) for e in entries]

    def _append_token(self, out: SequenceOutput) -> None:
        seq, group = self._seqs[out.seq_id]
        if seq.is_finished():  # aborted while its step ran
            return
        params = group.sampling_params
        seq.append_token_id(out.token_id, out.logprob)
        if params.logprobs is not None:
            seq.output_logprobs.append(self._to_logprob_dict(out.logprobs))
        new_char_count = 0
        detokenizer = self._detokenizers.get(seq.seq_id)
        if detokenizer is not None:
            if group.request_id in self._failed_requests:
                return
            try:
                new_text = detokenizer.step(out.token_id)
            except Exception as exc:  # noqa: BLE001 - a detokenizer bug fails its own request only
                logger.exception("Request %s failed in the detokenizer.", group.request_id)
                self._failed_requests[group.request_id] = exc
                return
            seq.output_text += new_text
            new_char_count = len(new_text)
        self._check_stop(seq, params, new_char_count)
        if seq.is_finished():
            self.scheduler.free_seq(seq)

    def _to_logprob_dict(self, entry: TokenLogprobs) -> dict[int, Logprob]:
        text = self._token_text
        result = {entry.token_id: Logprob(entry.logprob, entry.rank, text(entry.token_id) if text else None)}
        for rank, (token_id, logprob) in enumerate(entry.top, start=1):
            if token_id not in result:
                result[token_id] = Logprob(logprob, rank, text(token_id) if text else None)
        return result

    def _check_stop(self, seq: Sequence, params: SamplingParams, new_char_count: int) -> None:
        """vLLM's stop rules, in order: min_tokens holds everything back but length;
        then EOS, stop token ids, stop strings, and the two length limits."""
        output_len = seq.get_output_len()
        last_token = seq.get_last_token_id()
        if output_len >= params.min_tokens:
            if not params.ignore_eos and last_token == self.eos_token_id:
                seq.status = SequenceStatus.FINISHED_STOPPED
                return
            if last_token in params.stop_token_ids:
                seq.status = SequenceStatus.FINISHED_STOPPED
                seq.stop_reason = last_token
                return
            if params.stop and new_char_count:
                found = find_stop_string(seq.output_text, new_char_count, params.stop,
                                         params.include_stop_str_in_output)
                if found is not None:
                    seq.stop_reason, cut = found
                    seq.output_text = seq.output_text[:cut]
                    seq.status = SequenceStatus.FINISHED_STOPPED
                    return
        if output_len >= params.max_tokens or seq.get_len() >= self.model_config.max_model_len:
            seq.status = SequenceStatus.FINISHED_LENGTH_CAPPED

    # ---------------------------------------------------------------- outputs
    def _make_output(self, group: SequenceGroup, now: float) -> RequestOutput | None:
        finished = group.is_finished()
        params = group.sampling_params
        if params.output_kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        if finished and group.metrics.finished_time is None:
            group.metrics.finished_time = now
        seqs = group.get_seqs()
        if finished and params.best_of > params.n:
            # best_of: keep the n samples the model found most likely.
            seqs = sorted(seqs, key=lambda s: s.data.cumulative_logprob, reverse=True)[:params.n]
        else:
            seqs = seqs[:params.n]
        delta = params.output_kind == RequestOutputKind.DELTA
        completions = [self._make_completion(index, seq, params, delta) for index, seq in enumerate(seqs)]
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, group.prompt_logprobs,
                             completions, finished, group.metrics)

    def _make_completion(self, index: int, seq: Sequence, params: SamplingParams, delta: bool) -> CompletionOutput:
        token_ids = seq.data.output_token_ids
        text = seq.output_text
        logprobs = seq.output_logprobs if params.logprobs is not None else None
        if delta:
            sent_tokens, sent_chars = seq.delta_offsets
            seq.delta_offsets = (len(token_ids), len(text))
            token_ids, text = token_ids[sent_tokens:], text[sent_chars:]
            logprobs = logprobs[sent_tokens:] if logprobs is not None else None
        else:
            token_ids = list(token_ids)
            logprobs = list(logprobs) if logprobs is not None else None
        return CompletionOutput(index, text, token_ids, seq.data.cumulative_logprob, logprobs,
                                SequenceStatus.get_finished_reason(seq.status), seq.stop_reason)

    def _forget_group(self, group: SequenceGroup) -> None:
        self._request_ids.discard(group.request_id)
        for seq in group.seqs:
            self._seqs.pop(seq.seq_id, None)
            self._detokenizers.pop(seq.seq_id, None)

    # -------------------------------------------------------------- lifecycle
    def check_health(self) -> None:
        self.executor.check_health()

    def shutdown(self) -> None:
        self.executor.shutdown()

    def get_tokenizer(self) -> Any:
        return self.tokenizer


def _executor_class(engine_config: EngineConfig) -> type:
    if engine_config.parallel_config.use_ray:
        from raylm.executors.ray_gpu_executor import RayGPUExecutor

        return RayGPUExecutor
    if engine_config.parallel_config.tensor_parallel_size > 1:
        raise ValueError("tensor_parallel_size > 1 needs the Ray executor (distributed_executor_backend='ray').")
    from raylm.executors.uniproc_executor import UniProcExecutor

    return UniProcExecutor

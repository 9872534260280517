"""`LLMEngine`: takes requests, steps the scheduler and the executor, returns outputs."""

from __future__ import annotations

import copy
import functools
import logging
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from raylm.engine.arg_utils import EngineArgs
from raylm.engine.config import EngineConfig
from raylm.engine.engine_core import EngineCore
from raylm.engine.generation_config import load_generation_defaults
from raylm.engine.lora_request import LoRARequest
from raylm.engine.multimodal.inputs import MultiModalFeature
from raylm.engine.multimodal.processor import MultiModalProcessor
from raylm.engine.output_processor import OutputProcessor, ParentRequest
from raylm.engine.outputs import RequestOutput
from raylm.engine.prompt_embeds import (PLACEHOLDER_TOKEN_ID, PROMPT_EMBEDS_KEY, check_prompt_embeds,
                                        is_embeds_prompt)
from raylm.engine.request import MAX_CACHE_SALT_CHARS, Request, check_priority
from raylm.engine.pooling_activation import pooling_activations
from raylm.engine.pooling_params import PoolingParams
from raylm.engine.sampling_params import ParameterError, RequestOutputKind, SamplingParams
from raylm.engine.structured_output.manager import StructuredOutputManager
from raylm.engine.structured_output.params import StructuredOutputsParams
from raylm.engine.tokenizer import check_unicode, get_tokenizer
from raylm.engine.usage_context import UsageContext

if TYPE_CHECKING:
    from raylm.executors.lora_adapter import AdapterDigest

logger = logging.getLogger(__name__)
# Worker methods that need the engine's LoRA slots (enable_lora=True).
LORA_WORKER_METHODS = frozenset({"add_lora", "remove_lora", "list_loras"})

# A prompt: text, token ids, or vLLM's dict forms {"prompt": str} / {"prompt_token_ids": [...]},
# either with an optional "cache_salt" (a non-empty string: prefix-cache hits only between
# requests of the same salt); for a vision-language model, {"prompt": str, "multi_modal_data":
# {"image": PIL.Image or a list of them}}, one "<image>" placeholder in the text per image; or,
# processed already by the model's processor (the chat route's), {"prompt_token_ids": expanded
# ids, "mm_features": [MultiModalFeature, ...]} (vLLM V1's processed request carries mm_features);
# or, with enable_prompt_embeds, vLLM's EmbedsPrompt {"prompt_embeds": tensor [num_tokens, hidden]}.
PromptType = str | list[int] | dict[str, Any]


class LLMEngine:
    """Runs requests to completion, one `step()` at a time.

    Each step the `EngineCore` schedules a batch (continuous batching: requests join and
    leave at any step; long prompts are chunked; cached prefixes are skipped), runs it on
    the executor's workers and applies the token-level stops; the `OutputProcessor` turns
    the new tokens into text and `RequestOutput`s and finds stop strings.
    """

    def __init__(self, engine_config: EngineConfig, log_stats: bool = True,
                 start_grammar_compile_worker: bool = False) -> None:
        """`start_grammar_compile_worker`: start the grammar compile worker process now,
        before the model loads (a server does: its import of xgrammar and index of the
        vocabulary, seconds of CPU, then overlap the load instead of following it); else
        it starts on the first constrained request."""
        self.engine_config = engine_config
        self.model_config = engine_config.model_config
        start = time.perf_counter()
        self.tokenizer = None if self.model_config.skip_tokenizer_init else get_tokenizer(
            self.model_config.tokenizer, self.model_config.trust_remote_code, self.model_config.revision,
            self.model_config.tokenizer_mode)
        logger.info("Tokenizer loaded in %.1f s.", time.perf_counter() - start)
        self.generation_defaults = load_generation_defaults(self.model_config.model,
                                                            self.model_config.generation_config,
                                                            self.model_config.override_generation_config)
        self.eos_token_ids = self._find_eos_token_ids()
        # Vision-language models: prompts with images go through the model's own processor.
        self.mm_processor = (MultiModalProcessor(self.model_config.model, self.model_config.hf_config,
                                                 self.model_config.limit_mm_per_prompt or {},
                                                 self.model_config.trust_remote_code, self.model_config.revision)
                             if self.model_config.is_multimodal else None)
        # Grammars for structured outputs are built over the tokenizer's vocabulary.
        self.structured_output_manager = None if self.tokenizer is None else StructuredOutputManager(
            self.tokenizer, self.model_config.vocab_size, self.eos_token_ids)
        if start_grammar_compile_worker and self.structured_output_manager is not None:
            self.structured_output_manager.start_warm_up()  # not waited for here (build_app waits)
        try:
            self.engine_core = EngineCore(engine_config, self.eos_token_ids, log_stats=log_stats,
                                          structured_output_manager=self.structured_output_manager)
        except BaseException:
            if self.structured_output_manager is not None:
                self.structured_output_manager.shutdown()  # ends a compile worker started above
            raise
        self.output_processor = OutputProcessor(self.tokenizer)
        self._overlap_output_processing = (self.engine_core.runs_steps_asynchronously
                                           and not engine_config.scheduler_config.disable_async_output_proc)
        # Requests that failed inside the engine (a detokenizer error): already aborted,
        # reported through pop_failed_requests(); the rest of the batch goes on.
        self._failed_requests: dict[str, BaseException] = {}
        # Prompt tokens of the requests accepted since start.
        self.num_prompt_tokens_total = 0
        self.is_pooling = self.model_config.is_pooling
        self._process_outputs = self.output_processor.process_outputs
        if self.is_pooling:
            activations = (pooling_activations(self.model_config.hf_config)
                           if self.model_config.pooling_task == "classify" else None)
            self._process_outputs = functools.partial(self.output_processor.process_pooling_outputs,
                                                      default_normalize=self.model_config.pooler_config.normalize,
                                                      activations=activations)

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs,
                         usage_context: UsageContext = UsageContext.ENGINE_CONTEXT) -> "LLMEngine":
        return cls(engine_args.create_engine_config(usage_context), log_stats=not engine_args.disable_log_stats,
                   start_grammar_compile_worker=usage_context == UsageContext.OPENAI_API_SERVER)

    @property
    def scheduler(self) -> Any:
        return self.engine_core.scheduler

    @property
    def executor(self) -> Any:
        return self.engine_core.executor

    @property
    def stat_logger(self) -> Any:
        return self.engine_core.stat_logger

    def _find_eos_token_ids(self) -> list[int]:
        """Every EOS id the model names: config.json's (an int or a list) and
        generation_config.json's, else the tokenizer's."""
        eos = getattr(self.model_config.hf_config, "eos_token_id", None)
        ids = [eos] if isinstance(eos, int) else list(eos or [])
        ids += [t for t in self.generation_defaults.eos_token_ids if t not in ids]
        if not ids and self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids = [self.tokenizer.eos_token_id]
        return ids

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's defaults, overridden by what the model's generation config sets."""
        return SamplingParams(**self.generation_defaults.sampling)

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    # --------------------------------------------------------------- requests
    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | PoolingParams | None = None,
                    arrival_time: float | None = None, lora_request: LoRARequest | None = None,
                    priority: int = 0) -> None:
        """Validates a request and queues it; raises ValueError for bad input. The
        caller's `params` is never changed: the engine works on its own copy.
        `lora_request` runs it under a LoRA adapter (needs enable_lora). PoolingParams
        make it a pooling request (an engine with runner='pooling' takes only those).
        `priority` (vLLM's): under scheduling_policy "priority", lower is scheduled first
        (ties by arrival); an int in [-2**31, 2**31 - 1], and 0 under "fcfs"."""
        self.engine_core.check_awake()
        if request_id in self.output_processor.parents:
            raise ValueError(f"request_id {request_id!r} is already running.")
        priority = check_priority(priority, self.engine_config.scheduler_config.policy)
        if isinstance(params, PoolingParams) or (params is None and self.is_pooling):
            self._add_pooling_request(request_id, prompt, params or PoolingParams(), arrival_time, lora_request,
                                      priority)
            return
        if self.is_pooling:
            raise ValueError("This engine runs runner='pooling' (embeddings): it pools prompts and generates no "
                             "text. Start it with runner='generate' to generate (LLM.generate, the completions and "
                             "chat routes).")
        params = self.get_default_sampling_params() if params is None else params
        lora_digest = self._check_lora_request(lora_request)
        cache_salt = cache_salt_of(prompt)
        prompt_embeds = None
        if is_embeds_prompt(prompt):
            prompt_embeds = self._process_embeds_prompt(prompt, params)
            prompt_text, prompt_token_ids, mm_features = None, [PLACEHOLDER_TOKEN_ID] * len(prompt_embeds), []
        else:
            prompt_text, prompt_token_ids, mm_features = self._process_prompt(prompt)
        if mm_features and params.truncate_prompt_tokens is not None:
            raise ParameterError("truncate_prompt_tokens is not supported with images (it could cut an image's "
                                 "placeholder tokens).", "truncate_prompt_tokens")
        prompt_token_ids = params.truncated_prompt(prompt_token_ids, self.model_config.max_model_len)
        self._validate_request(prompt_token_ids, params)
        params = self._with_engine_defaults(params, len(prompt_token_ids))
        arrival_time = arrival_time or time.time()
        parent = ParentRequest(request_id, prompt_text, prompt_token_ids, params, arrival_time,
                               prompt_is_embeds=prompt_embeds is not None)
        child_ids = self.output_processor.add_request(parent, params)
        # The prompt's logprobs are the parent's, the same for every sample: the first child
        # scores them, the others read the prompt's KV from the prefix cache.
        sibling_params = params
        if params.prompt_logprobs is not None and len(child_ids) > 1:
            sibling_params = copy.copy(params)
            sibling_params.prompt_logprobs = None
        for index, child_id in enumerate(child_ids):
            self.engine_core.add_request(Request(child_id, prompt_token_ids, sibling_params if index else params,
                                                 arrival_time, sample_index=index, priority=priority,
                                                 cache_salt=cache_salt, lora_request=lora_request,
                                                 lora_digest=lora_digest, mm_features=mm_features,
                                                 prompt_embeds=prompt_embeds))
        self.num_prompt_tokens_total += len(prompt_token_ids)

    def _add_pooling_request(self, request_id: str, prompt: PromptType, params: PoolingParams,
                             arrival_time: float | None, lora_request: LoRARequest | None, priority: int) -> None:
        """Queues a prompt to be prefilled once and pooled (its prompt truncated as
        truncate_prompt_tokens says, then checked like any prompt)."""
        if not self.is_pooling:
            raise ValueError("Embeddings (PoolingParams, LLM.embed, /v1/embeddings) need an engine started with "
                             "runner='pooling' (--runner pooling); this one runs runner='generate'.")
        if lora_request is not None:
            raise ParameterError("lora_request is not supported with runner='pooling' (yet).", "lora_request")
        cache_salt = cache_salt_of(prompt)
        prompt_text, prompt_token_ids = self._tokenize_prompt(prompt)
        max_model_len = self.model_config.max_model_len
        prompt_token_ids = params.truncate(prompt_token_ids, max_model_len)
        if len(prompt_token_ids) > max_model_len:
            raise ParameterError(f"The prompt is {len(prompt_token_ids)} tokens long, more than the model's context "
                                 f"length (max_model_len = {max_model_len}): shorten it, or set "
                                 f"truncate_prompt_tokens to pool only its last tokens.", "truncate_prompt_tokens")
        self._validate_prompt(prompt_token_ids)
        params = params.clone()
        params.resolve_task(self.model_config.pooling_task, self.model_config.supported_pooling_tasks)
        params.verify(self.model_config.hf_config, self.model_config.hf_config.hidden_size)
        # The scheduler's view of a pooling request: one step past the prompt's end, so that
        # it is never scheduled again once its last chunk is in flight; nothing samples.
        step_params = SamplingParams(max_tokens=1, output_kind=RequestOutputKind.FINAL_ONLY)
        step_params.all_stop_token_ids = set()
        arrival_time = arrival_time or time.time()
        parent = ParentRequest(request_id, prompt_text, prompt_token_ids, step_params, arrival_time)
        child_id = self.output_processor.add_pooling_request(parent, params)
        self.engine_core.add_request(Request(child_id, prompt_token_ids, step_params, arrival_time, priority=priority,
                                             cache_salt=cache_salt, pooling_params=params))
        self.num_prompt_tokens_total += len(prompt_token_ids)

    def _process_embeds_prompt(self, prompt: dict[str, Any], params: SamplingParams) -> Any:
        """The embeddings of an EmbedsPrompt ({"prompt_embeds": tensor}, with an optional
        "cache_salt"), checked (`check_prompt_embeds`, truncate_prompt_tokens applied) before
        anything is allocated for the request. Needs enable_prompt_embeds. Prompt logprobs
        need the prompt's tokens, which such a prompt does not have: refused, as by vLLM."""
        if not self.model_config.enable_prompt_embeds:
            raise ParameterError("prompt_embeds were given, but this engine was not started with "
                                 "enable_prompt_embeds=True (--enable-prompt-embeds).", PROMPT_EMBEDS_KEY)
        others = sorted(set(prompt) - {PROMPT_EMBEDS_KEY, "cache_salt"})
        if others:
            raise ParameterError(f"A prompt with prompt_embeds takes only 'cache_salt' beside them, got "
                                 f"{', '.join(map(repr, others))}.", PROMPT_EMBEDS_KEY)
        if params.prompt_logprobs is not None:
            raise ParameterError("prompt_logprobs is not supported with prompt_embeds: the prompt has no tokens to "
                                 "score.", "prompt_logprobs")
        return check_prompt_embeds(prompt[PROMPT_EMBEDS_KEY], self.model_config.hidden_size,
                                   self.model_config.max_model_len, self.model_config.dtype,
                                   truncate_prompt_tokens=params.truncate_prompt_tokens)

    def _process_prompt(self, prompt: PromptType) -> tuple[str | None, list[int], list[MultiModalFeature]]:
        """The prompt's text and token ids, and for a vision-language model the images of its
        "multi_modal_data" (vLLM's prompt key), their placeholders expanded by the model's own
        processor (`engine/multimodal/processor.py`)."""
        mm_data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
        mm_features = prompt.get("mm_features") if isinstance(prompt, dict) else None
        if self.mm_processor is None:
            if mm_data is not None or mm_features is not None:
                key = "multi_modal_data" if mm_data is not None else "mm_features"
                raise ParameterError(f"{key} was given, but the model {self.model_config.model!r} takes text only.",
                                     key)
            return *self._tokenize_prompt(prompt), []
        if mm_features is not None:
            # Processed already (the chat route counts the expanded prompt): the images'
            # pixels are not made twice, only checked against the ids.
            if mm_data is not None or not isinstance(prompt.get("prompt_token_ids"), list):
                raise ParameterError("mm_features goes with the expanded prompt_token_ids and without "
                                     "multi_modal_data.", "mm_features")
            text = prompt.get("prompt")
            prompt_token_ids = list(prompt["prompt_token_ids"])
            return (text if isinstance(text, str) else None, prompt_token_ids,
                    self.mm_processor.check_processed(prompt_token_ids, mm_features))
        if mm_data is None:
            prompt_text, prompt_token_ids = self._tokenize_prompt(prompt)
            self.mm_processor.check_no_placeholders(prompt_token_ids)
            return prompt_text, prompt_token_ids, []
        text = prompt.get("prompt")
        if "prompt_token_ids" in prompt:
            # As vLLM's TokensPrompt with images: one placeholder token per image, expanded
            # here, or the images' tokens expanded already (detected, not expanded again).
            prompt_token_ids, mm_features = self.mm_processor.process_tokens(prompt["prompt_token_ids"], mm_data)
            return text if isinstance(text, str) else None, prompt_token_ids, mm_features
        if not isinstance(text, str):
            raise ParameterError("multi_modal_data needs a text 'prompt' or 'prompt_token_ids'.", "multi_modal_data")
        check_unicode(text, "prompt")
        prompt_token_ids, mm_features = self.mm_processor.process(text, mm_data)
        return text, prompt_token_ids, mm_features

    def _tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if is_embeds_prompt(prompt):
            raise ParameterError("prompt_embeds are supported by generate requests only (not by beam search, "
                                 "pooling or tokenization).", PROMPT_EMBEDS_KEY)
        if isinstance(prompt, dict) and (prompt.get("multi_modal_data") is not None
                                         or prompt.get("mm_features") is not None):
            # Only add_request (LLM.generate, the completions and chat routes) takes images.
            key = "multi_modal_data" if prompt.get("multi_modal_data") is not None else "mm_features"
            raise ParameterError(f"{key} is supported by generate requests only (not by beam search, pooling or "
                                 f"tokenization).", key)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" not in prompt:
                raise ValueError("A prompt dict needs a 'prompt' (text) or 'prompt_token_ids' key.")
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("Text prompts need a tokenizer; this engine runs with skip_tokenizer_init.")
            check_unicode(prompt, "prompt")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise ValueError(f"A prompt must be a string, a list of token ids or a dict; got {type(prompt).__name__}.")

    def _validate_prompt(self, prompt_token_ids: list[int]) -> None:
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

    def _validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._validate_prompt(prompt_token_ids)
        vocab_size = self.model_config.vocab_size
        params.verify_vocab(vocab_size)
        if params.bad_words and self.tokenizer is None:
            raise ParameterError("bad_words need a tokenizer; this engine runs with skip_tokenizer_init.", "bad_words")
        if params.structured_outputs is not None and self.structured_output_manager is None:
            raise ParameterError("structured_outputs need a tokenizer; this engine runs with skip_tokenizer_init.",
                                 "structured_outputs")
        # vLLM's max_logprobs: every request counts, beam search's one-token steps too
        # (they ask for 2 x beam_width), so it bounds the beam width as in vLLM.
        max_logprobs = self.model_config.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is None:
                continue
            if 0 <= max_logprobs < value:
                beams = "; beam search asks for 2 x beam_width" if name == "logprobs" else ""
                raise ParameterError(f"{name} must be at most max_logprobs = {max_logprobs} (the engine argument "
                                     f"max_logprobs, --max-logprobs{beams}), got {value}.", name)
            if value > vocab_size:
                raise ParameterError(f"{name} must be at most the vocabulary size {vocab_size}, got {value}.", name)
        for entry in self.model_config.logits_processors:
            try:
                entry.cls.validate_params(params)
            except ValueError as error:  # the processor's refusal: the request's own mistake
                raise ParameterError(f"extra_args: the logits processor {entry.name} refused the request's "
                                     f"parameters: {error}", "extra_args") from error

    def _with_engine_defaults(self, params: SamplingParams, prompt_len: int) -> SamplingParams:
        """The engine's private copy of the request's parameters, with what depends on the
        model filled in: the stop ids (EOS included unless ignore_eos), max_tokens=None,
        and the token sequences of bad_words (tokenized here, once, within their bound)."""
        params = copy.copy(params)
        if params.bad_words:
            params.update_from_tokenizer(self.tokenizer)
            params.verify_vocab(self.model_config.vocab_size)
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids.update(self.eos_token_ids)
        params.all_stop_token_ids = stop_ids
        if params.max_tokens is None:
            params.max_tokens = self.model_config.max_model_len - prompt_len
        return params

    # ------------------------------------------------------------------- LoRA
    def _check_lora_request(self, lora_request: LoRARequest | None, allowed_dirs: Sequence[str] | None = None,
                            fresh: bool = False) -> AdapterDigest | None:
        """The digest of the adapter's files as checked (None for the base model)."""
        if lora_request is None:
            return None
        loader = self.engine_core.lora_loader
        if loader is None:
            raise ParameterError(f"lora_request {getattr(lora_request, 'lora_name', lora_request)!r}: LoRA adapters "
                                 f"need an engine started with enable_lora=True (--enable-lora).", "lora_request")
        return loader.check(lora_request, allowed_dirs, fresh=fresh)

    def add_lora(self, lora_request: LoRARequest, allowed_dirs: Sequence[str] | None = None) -> bool:
        """Loads an adapter into the workers' host memory now (vLLM's add_lora), so that its
        first request does not wait for it; raises ValueError for an adapter the engine cannot
        serve. Safe to call from another thread while the engine steps. `allowed_dirs`: the
        folders the adapter's folder and files must really be in, links followed (the
        server's --allowed-lora-dirs)."""
        self._check_lora_request(lora_request, allowed_dirs, fresh=True)  # never an earlier failure's verdict
        self.engine_core.lora_loader.load(lora_request, allowed_dirs=allowed_dirs)
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forgets an adapter and drops it from host memory; its requests already running
        finish with it. Call it between steps (AsyncLLMEngine.remove_lora does)."""
        return self.engine_core.remove_lora(lora_int_id)

    def list_loras(self) -> set[int]:
        """Ids of the adapters loaded in the workers' host memory."""
        loader = self.engine_core.lora_loader
        return set() if loader is None else {lora.lora_int_id for lora in loader.list_loras()}

    def _fail_requests_of_failed_loras(self) -> None:
        """Requests whose adapter failed to load end with the load's error."""
        failed = self.engine_core.fail_requests_of_failed_loras()
        for child_id, error in failed.items():
            state = self.output_processor.request_states.get(child_id)
            if state is None:
                continue
            parent_id = state.parent.request_id
            self._failed_requests[parent_id] = error
            self.engine_core.abort_requests(self.output_processor.abort_requests([parent_id]))

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Stops requests; their blocks go back to the pool at once."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        self.engine_core.abort_requests(self.output_processor.abort_requests(ids))

    def pop_failed_requests(self) -> dict[str, BaseException]:
        """Requests that failed inside the engine since the last call, with their errors.
        They are already aborted: their blocks are back in the pool."""
        failed, self._failed_requests = self._failed_requests, {}
        return failed

    def has_unfinished_requests(self) -> bool:
        """Whether step() has work: requests, a batch in flight, or the workers' state of an
        ended request to release (images, allowed_token_ids masks: a step of their own)."""
        return (self.output_processor.has_unfinished_requests() or self.engine_core.has_step_in_flight()
                or self.scheduler.has_worker_releases())

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests()

    # ------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Runs one batch and returns the outputs of the requests it advanced.

        With workers in other processes (Ray) and async output processing on (vLLM's
        `disable_async_output_proc=False`), the outputs are those of the batch the previous
        call started: this call applies its tokens, starts the next batch, and makes the
        text while the workers run it. With async scheduling (the default with Ray) this
        call starts the next batch first, then collects the previous one (under pipeline
        parallel, the oldest of up to pipeline_parallel_size + 1). Either way the first
        call of a run returns [], and `has_unfinished_requests` stays True until the last
        batch is collected."""
        core = self.engine_core
        if core.lora_loader is not None:
            self._fail_requests_of_failed_loras()
        if core.async_scheduling:
            # Step k+1 goes to the workers before step k is collected: they never wait for
            # the driver, whose scheduling and output processing run beside the forward.
            started = core.start_step()
            in_flight_full = core.num_steps_in_flight >= core.max_steps_in_flight
            core_outputs = core.finish_step() if in_flight_full or not started else []
        elif self._overlap_output_processing:
            core_outputs = core.finish_step()
            core.start_step()
        else:
            core_outputs = core.step()
        outputs, to_stop, failed = self._process_outputs(core_outputs)
        if to_stop:
            self.engine_core.stop_requests(to_stop)
        self._failed_requests.update(failed)
        self._fail_core_failures()
        return outputs

    def _fail_core_failures(self) -> None:
        """Requests the core ended on an error (their grammar did not compile, or refused a
        token): their whole parent request fails, its other samples aborted."""
        for child_id, error in self.engine_core.pop_failed_requests().items():
            state = self.output_processor.request_states.get(child_id)
            if state is None:
                continue  # its parent already failed or was aborted
            self._failed_requests[state.parent.request_id] = error
            self.abort_request(state.parent.request_id)

    def compile_structured_outputs(self, params: StructuredOutputsParams, timeout_s: float | None = None) -> None:
        """Compiles (or finds cached) the grammar of a constraint, blocking; raises
        StructuredOutputsError (a ValueError naming the field) if it does not compile, or
        not within `timeout_s` seconds. Requests with the constraint then start at once."""
        if self.structured_output_manager is None:
            raise ParameterError("structured_outputs need a tokenizer; this engine runs with skip_tokenizer_init.",
                                 params.source)
        self.structured_output_manager.wait_compiled(params, timeout_s)

    # ------------------------------------------------- sleep mode, worker calls
    def sleep(self, level: int = 1) -> list[str]:
        """vLLM's sleep: aborts every unfinished request (returns their ids), then frees
        the KV cache (prefix cache reset) and, at level 1, offloads the weights to host
        memory or, at level 2, discards them. Needs enable_sleep_mode. See `LLM.sleep`."""
        self.engine_core.check_sleep_level(level)
        aborted = list(self.output_processor.parents)
        self.abort_request(aborted)
        self.engine_core.sleep(level)
        return aborted

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.engine_core.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.engine_core.is_sleeping()

    def reset_prefix_cache(self) -> bool:
        return self.engine_core.reset_prefix_cache()

    def collective_rpc(self, method: Any, timeout: float | None = None, args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        """`Worker.<method>(*args, **kwargs)` on every worker (a callable gets the worker
        first); the results in rank order. A method name that is not a public method of the
        workers, one the engine drives (sleep, wake_up, ...: see
        ENGINE_DRIVEN_WORKER_METHODS), or arguments its signature does not take are a
        ParameterError naming `method` or `args`, before any worker runs."""
        if isinstance(method, str):
            from raylm.executors.worker import Worker, check_rpc_method, worker_class

            try:
                worker_cls = worker_class(self.engine_config)
            except ValueError:  # worker_extension_cls imports on the Ray workers only: check ours
                worker_cls = Worker if hasattr(Worker, method) else None
            if worker_cls is not None:
                check_rpc_method(worker_cls, method, tuple(args), kwargs or {})
            if method in LORA_WORKER_METHODS and self.engine_config.lora_config is None:
                # The workers would raise a RuntimeError (a 500 over HTTP): the caller's mistake.
                raise ParameterError(f"method {method!r} needs an engine started with enable_lora=True.", "method")
        return self.engine_core.executor.collective_rpc(method, *args, timeout=timeout, kwargs=kwargs,
                                                        raised_is_fatal=False)

    # -------------------------------------------------------------- lifecycle
    def check_health(self) -> None:
        self.engine_core.check_health()

    def shutdown(self) -> None:
        self.engine_core.shutdown()
        if self.structured_output_manager is not None:
            self.structured_output_manager.shutdown()

    def get_tokenizer(self) -> Any:
        return self.tokenizer


def cache_salt_of(prompt: PromptType) -> str | None:
    """The prompt dict's "cache_salt" (vLLM's field), checked: None or a non-empty string of
    at most MAX_CACHE_SALT_CHARS characters."""
    if not isinstance(prompt, dict) or prompt.get("cache_salt") is None:
        return None
    salt = prompt["cache_salt"]
    if not isinstance(salt, str):
        got = f"a value of type {type(salt).__name__}"
    elif not salt:
        got = "an empty string"
    elif len(salt) > MAX_CACHE_SALT_CHARS:
        got = f"a string of {len(salt)} characters"
    else:
        check_unicode(salt, "cache_salt")  # its blocks' hashes encode it
        return salt
    raise ParameterError(f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters, "
                         f"got {got}.", "cache_salt")

"""`LLM`: offline batched generation, the way vLLM users write it."""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Sequence as SequenceABC
from typing import Any

from tqdm.auto import tqdm

from raylm.engine.arg_utils import EngineArgs
from raylm.engine.beam_search import (BeamSearchDriver, BeamSearchOutput, BeamSearchParams, StepRequests,
                                      beam_search_params_from, beam_search_request_output, run_sync)
from raylm.engine.llm_engine import LLMEngine, PromptType, cache_salt_of
from raylm.engine.logger import init_default_logging
from raylm.engine.lora_request import LoRARequest
from raylm.engine.outputs import EmbeddingRequestOutput, PoolingRequestOutput, RequestOutput
from raylm.engine.pooling_params import PoolingParams
from raylm.engine.sampling_params import ParameterError, RequestOutputKind, SamplingParams
from raylm.engine.tokenizer import check_unicode
from raylm.engine.usage_context import UsageContext

ChatMessages = list[dict[str, Any]]


class LLM:
    """An engine for offline generation over a batch of prompts.

    Args:
        model: Hugging Face model folder (config.json, *.safetensors, tokenizer files).
            When omitted, or given as its short name "raylm-demo-code", raylm's bundled
            demo model.
        **kwargs: Engine arguments with vLLM's names and defaults (see `EngineArgs`):
            `dtype="auto"`, `max_model_len=None` (the model's), `block_size=16`,
            `seed=0`, `max_num_seqs=256`, `max_num_batched_tokens=None` (2048 with chunked prefill),
            `gpu_memory_utilization=0.9`, `tensor_parallel_size=1`,
            `trust_remote_code=False`, `num_gpu_blocks_override=None`,
            `enable_prefix_caching=True`, `enable_chunked_prefill=True`,
            `kv_cache_space=None` (GiB, CPU; None sizes the pool to what max_num_seqs
            requests of max_model_len tokens can fill), `kv_cache_dtype="auto"` ("fp8",
            "fp8_e4m3", "fp8_e5m2": one byte a cached element, twice the blocks;
            docs/quantized_kv_cache.md), `enable_lora=False` (serve LoRA
            adapters, see `generate`'s lora_request), `max_loras=1` (adapters in one
            batch), `max_lora_rank=16`, `max_cpu_loras=None` (adapters kept in host memory;
            max_loras), `runner="auto"` ("pooling" for embeddings, see `embed`; "auto" pools
            bare-decoder checkpoints such as `MistralModel` and folders with
            sentence-transformers pooling files), `pooler_config=None` (runner "pooling":
            {"pooling_type": "LAST" | "MEAN" | "CLS", "normalize": True}, or what the
            folder's sentence-transformers files say), `load_format="auto"` ("dummy": random
            weights, no checkpoint read, to measure speed). An unknown argument is a TypeError
            naming it.

    Loading logs its stages (tokenizer, weights, KV cache) at INFO to stderr unless the
    application configured logging first (see `raylm.engine.logger`).
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        init_default_logging()
        engine_args = EngineArgs.from_kwargs(model=model, **kwargs)
        self.llm_engine = LLMEngine.from_engine_args(engine_args, UsageContext.LLM_CLASS)
        self._request_counter = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.llm_engine.get_tokenizer()

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` uses when given no sampling_params: vLLM's defaults, overridden
        by the sampling fields of the model's generation_config.json (unless the engine
        argument generation_config='vllm') and then by override_generation_config's."""
        return self.llm_engine.get_default_sampling_params()

    def generate(self, prompts: PromptType | SequenceABC[PromptType],
                 sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 lora_request: LoRARequest | SequenceABC[LoRARequest | None] | None = None,
                 priority: SequenceABC[int] | None = None) -> list[RequestOutput]:
        """Generates completions for prompts, returned in prompt order.

        prompts: a string, a list of token ids, a dict with "prompt" or
        "prompt_token_ids", or a list of any of these. sampling_params: one for all
        prompts or one per prompt; default `get_default_sampling_params()`.
        lora_request: the LoRA adapter to run every prompt under, or a list with one per
        prompt (None: the base model); needs enable_lora. One batch mixes them; prompts of
        more adapters than max_loras wait for a slot. A bad adapter is a ValueError.
        priority: one int per prompt (vLLM's), only with scheduling_policy="priority":
        lower is scheduled first, ties in prompt order; default 0 for every prompt. Not
        with beam search.
        """
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params_list = _as_params_list(sampling_params, len(prompt_list))
        lora_list = _as_lora_list(lora_request, len(prompt_list))
        priority_list = _as_priority_list(priority, len(prompt_list))
        if any(params.use_beam_search for params in params_list):
            if any(priority_list):
                raise ParameterError("priority is not supported with beam search (use_beam_search).", "priority")
            return self._generate_with_beam_search(prompt_list, params_list, use_tqdm, lora_list)
        return self._run(prompt_list, params_list, use_tqdm, lora_list, priority_list)

    def embed(self, prompts: PromptType | SequenceABC[PromptType], *, truncate_prompt_tokens: int | None = None,
              use_tqdm: bool = True, pooling_params: PoolingParams | SequenceABC[PoolingParams] | None = None
              ) -> list[EmbeddingRequestOutput]:
        """The embedding of each prompt, in prompt order (vLLM's LLM.embed); needs an engine
        started with runner='pooling'. prompts as in `generate`. pooling_params: one for all
        prompts or one per prompt (default PoolingParams()); truncate_prompt_tokens, when
        given, sets theirs (see PoolingParams)."""
        params_list = self._pooling_params_list(prompts, pooling_params, truncate_prompt_tokens)
        return [EmbeddingRequestOutput.from_base(output)
                for output in self._run_pooling(_as_prompt_list(prompts), params_list, use_tqdm)]

    def encode(self, prompts: PromptType | SequenceABC[PromptType],
               pooling_params: PoolingParams | SequenceABC[PoolingParams] | None = None, *,
               truncate_prompt_tokens: int | None = None, use_tqdm: bool = True) -> list[PoolingRequestOutput]:
        """The pooled vector of each prompt as a tensor (vLLM's LLM.encode); as `embed`."""
        params_list = self._pooling_params_list(prompts, pooling_params, truncate_prompt_tokens)
        return self._run_pooling(_as_prompt_list(prompts), params_list, use_tqdm)

    def _pooling_params_list(self, prompts: Any, pooling_params: Any,
                             truncate_prompt_tokens: int | None) -> list[PoolingParams]:
        if not self.llm_engine.is_pooling:
            raise ValueError("LLM.embed and LLM.encode need a pooling model: start the LLM with runner='pooling' "
                             "(vLLM's --runner pooling, or the older task='embed').")
        count = len(_as_prompt_list(prompts))
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            params_list = [pooling_params or PoolingParams()] * count
        else:
            params_list = list(pooling_params)
            if len(params_list) != count:
                raise ValueError(f"Got {len(params_list)} pooling_params for {count} prompts: give one, or one per "
                                 f"prompt.")
        if truncate_prompt_tokens is not None:
            params_list = [dataclasses.replace(params, truncate_prompt_tokens=truncate_prompt_tokens)
                           for params in params_list]
        return params_list

    def _run_pooling(self, prompts: list[PromptType], params_list: list[PoolingParams],
                     use_tqdm: bool) -> list[PoolingRequestOutput]:
        engine = self.llm_engine
        request_ids: list[str] = []
        finished: dict[str, PoolingRequestOutput] = {}
        try:
            for prompt, params in zip(prompts, params_list):
                request_id = str(next(self._request_counter))
                engine.add_request(request_id, prompt, params)
                request_ids.append(request_id)
            with tqdm(total=len(request_ids), desc="Processed prompts", dynamic_ncols=True,
                      disable=not use_tqdm) as progress:
                while engine.has_unfinished_requests():
                    for output in engine.step():
                        finished[output.request_id] = output
                        progress.update(1)
        except BaseException:
            # A bad prompt in the list, Ctrl-C or a worker failure: leave nothing queued.
            engine.abort_request(request_ids)
            raise
        return [finished[request_id] for request_id in request_ids]

    def beam_search(self, prompts: PromptType | SequenceABC[PromptType], params: BeamSearchParams,
                    use_tqdm: bool = False,
                    lora_request: LoRARequest | SequenceABC[LoRARequest | None] | None = None
                    ) -> list[BeamSearchOutput]:
        """Beam search (Hugging Face's algorithm) for each prompt; returns its beam_width
        best beams, best first, with their tokens, text and scores. Beams are one-token
        requests to the engine, so the prompts' and the beams' common prefixes share KV
        blocks through the prefix cache. lora_request as in `generate`."""
        engine = self.llm_engine
        prompt_list = _as_prompt_list(prompts)
        driver = BeamSearchDriver([(engine._tokenize_prompt(prompt)[1], params) for prompt in prompt_list],
                                  engine.eos_token_ids, [cache_salt_of(prompt) for prompt in prompt_list],
                                  _as_lora_list(lora_request, len(prompt_list)))
        with tqdm(total=params.max_tokens, desc="Beam search", disable=not use_tqdm) as progress:
            run_sync(driver, functools.partial(self._run_beam_step, driver), lambda: progress.update(1))
        return driver.outputs(self.get_tokenizer())

    def _run_beam_step(self, driver: BeamSearchDriver, requests: StepRequests) -> list[RequestOutput]:
        return self._run([prompt for prompt, _ in requests], [params for _, params in requests], False,
                         driver.step_lora_requests())

    def _generate_with_beam_search(self, prompts: list[PromptType], params_list: list[SamplingParams],
                                   use_tqdm: bool, lora_list: list[LoRARequest | None]) -> list[RequestOutput]:
        """vLLM 0.4's `SamplingParams(use_beam_search=True)`: each prompt's n best of
        best_of beams as its completions; the beam searches step together."""
        outputs: list[RequestOutput | None] = [None] * len(prompts)
        sampled = [i for i, params in enumerate(params_list) if not params.use_beam_search]
        if sampled:
            for i, output in zip(sampled, self._run([prompts[i] for i in sampled], [params_list[i] for i in sampled],
                                                    use_tqdm, [lora_list[i] for i in sampled])):
                outputs[i] = output
        searched = [i for i, params in enumerate(params_list) if params.use_beam_search]
        max_model_len = self.llm_engine.model_config.max_model_len
        tokenized = [self.llm_engine._tokenize_prompt(prompts[i]) for i in searched]
        tokenized = [(text, params_list[i].truncated_prompt(token_ids, max_model_len))
                     for i, (text, token_ids) in zip(searched, tokenized)]
        driver = BeamSearchDriver(
            [(token_ids, beam_search_params_from(params_list[i], params_list[i].max_tokens
                                                 or max_model_len - len(token_ids)))
             for i, (_, token_ids) in zip(searched, tokenized)], self.llm_engine.eos_token_ids,
            [cache_salt_of(prompts[i]) for i in searched], [lora_list[i] for i in searched])
        run_sync(driver, functools.partial(self._run_beam_step, driver))
        for i, (prompt_text, token_ids), result in zip(searched, tokenized, driver.outputs(self.get_tokenizer())):
            outputs[i] = beam_search_request_output(str(next(self._request_counter)), prompt_text, token_ids, result,
                                                    params_list[i].n)
        return outputs

    def chat(self, messages: ChatMessages | list[ChatMessages],
             sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
             use_tqdm: bool = True, chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False) -> list[RequestOutput]:
        """Generates replies to conversations rendered with the tokenizer's chat template
        (or `chat_template`). messages: one conversation or a list of them."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer = self.get_tokenizer()
        prompts: list[PromptType] = []
        for conversation in conversations:
            text = tokenizer.apply_chat_template(
                conversation, chat_template=chat_template, tokenize=False,
                add_generation_prompt=add_generation_prompt and not continue_final_message,
                continue_final_message=continue_final_message)
            check_unicode(text, "messages")
            # The template already holds any BOS it wants: do not add special tokens again.
            prompts.append({"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, prompts: list[PromptType], params_list: list[SamplingParams],
             use_tqdm: bool, lora_list: list[LoRARequest | None] | None = None,
             priority_list: list[int] | None = None) -> list[RequestOutput]:
        engine = self.llm_engine
        self._compile_grammars(params_list)
        request_ids: list[str] = []
        lora_list = lora_list or [None] * len(prompts)
        priority_list = priority_list or [0] * len(prompts)
        try:
            for prompt, params, lora, priority in zip(prompts, params_list, lora_list, priority_list):
                request_id = str(next(self._request_counter))
                params = _final_only(params)
                engine.add_request(request_id, prompt, params, lora_request=lora, priority=priority)
                request_ids.append(request_id)
            return self._run_engine(request_ids, use_tqdm)
        except BaseException:
            # A bad prompt in the list, Ctrl-C or a worker failure: leave nothing queued.
            engine.abort_request(request_ids)
            raise

    def _compile_grammars(self, params_list: list[SamplingParams]) -> None:
        """Compiles the structured-output grammars of a batch side by side, before any of its
        requests is queued: a constraint that does not compile is a ValueError naming it."""
        constraints = {params.structured_outputs.cache_key(): params.structured_outputs
                       for params in params_list if params.structured_outputs is not None}
        manager = self.llm_engine.structured_output_manager
        if manager is not None:
            for constraint in constraints.values():
                manager.compile(constraint)
        for constraint in constraints.values():
            self.llm_engine.compile_structured_outputs(constraint)

    def _run_engine(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        finished: dict[str, RequestOutput] = {}
        progress = tqdm(total=len(request_ids), desc="Processed prompts", dynamic_ncols=True,
                        disable=not use_tqdm)
        prompt_tokens = output_tokens = 0
        with progress:
            while engine.has_unfinished_requests():
                outputs = engine.step()
                failed = engine.pop_failed_requests()
                if failed:
                    request_id, error = next(iter(failed.items()))
                    raise RuntimeError(f"Request {request_id} failed: {error!r}") from error
                for output in outputs:
                    if not output.finished:
                        continue
                    finished[output.request_id] = output
                    prompt_tokens += len(output.prompt_token_ids)
                    output_tokens += sum(len(c.token_ids) for c in output.outputs)
                    progress.update(1)
                    elapsed = progress.format_dict["elapsed"] or 1e-9
                    progress.set_postfix_str(f"est. speed input: {prompt_tokens / elapsed:.2f} toks/s, "
                                             f"output: {output_tokens / elapsed:.2f} toks/s", refresh=False)
        return [finished[request_id] for request_id in request_ids]

    def shutdown(self) -> None:
        """Releases the workers (Ray actors and placement group, when used)."""
        self.llm_engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _as_prompt_list(prompts: Any) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, (list, tuple)):
        if prompts and all(isinstance(t, int) for t in prompts):
            return [list(prompts)]  # one prompt of token ids
        return list(prompts)
    raise ValueError(f"prompts must be a string, token ids, a dict or a list of these; "
                     f"got {type(prompts).__name__}.")


def _as_params_list(params: Any, count: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(count)]
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"Got {len(params)} sampling_params for {count} prompts: give one, or one per prompt.")
    return params


def _as_lora_list(lora_request: Any, count: int) -> list[LoRARequest | None]:
    """One adapter (or None) per prompt, from one for all or a list of one per prompt."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * count
    if not isinstance(lora_request, (list, tuple)):
        raise ValueError(f"lora_request must be a LoRARequest, a list of them (one per prompt) or None; got "
                         f"{type(lora_request).__name__}.")
    if len(lora_request) != count:
        raise ValueError(f"Got {len(lora_request)} lora_requests for {count} prompts: give one, or one per prompt.")
    return list(lora_request)


def _as_priority_list(priority: Any, count: int) -> list[int]:
    """One priority per prompt (vLLM's generate takes a list); each is checked by the engine."""
    if priority is None:
        return [0] * count
    if not isinstance(priority, (list, tuple)):
        raise ParameterError(f"priority must be a list of integers, one per prompt; got "
                             f"{type(priority).__name__}.", "priority")
    if len(priority) != count:
        raise ParameterError(f"Got {len(priority)} priorities for {count} prompts: give one per prompt.", "priority")
    return list(priority)


def _final_only(params: SamplingParams) -> SamplingParams:
    """LLM.generate reads only finished outputs; a private copy keeps the caller's object
    untouched (it may be shared with other prompts)."""
    import copy

    params = copy.copy(params)
    params.output_kind = RequestOutputKind.FINAL_ONLY
    return params

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
from raylm.engine.multimodal.chat_parts import split_chat_images
from raylm.engine.outputs import (ClassificationRequestOutput, EmbeddingRequestOutput, PoolingRequestOutput,
                                  RequestOutput, ScoringRequestOutput)
from raylm.engine.pooling_params import PoolingParams
from raylm.engine.scoring import cross_encoder_prompt, embedding_scores
from raylm.engine.sampling_params import (ParameterError, RequestOutputKind, SamplingParams,
                                          check_truncate_prompt_tokens, truncated_prompt)
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
            bare-decoder checkpoints such as `MistralModel`, folders with
            sentence-transformers pooling files, and sequence classifiers, see `classify`
            and `score`), `pooler_config=None` (runner "pooling":
            {"pooling_type": "LAST" | "MEAN" | "CLS", "normalize": True}, or what the
            folder's sentence-transformers files say), `load_format="auto"` ("dummy": random
            weights, no checkpoint read, to measure speed), `quantization=None` ("fp8": FP8
            linear weights quantized at load; None reads an FP8 checkpoint's
            quantization_config: "fp8", "compressed-tensors" (FP8, W4A16, W8A16), "gptq",
            "awq"; docs/quantization.md),
            `enable_prompt_embeds=False` (True: `generate` takes {"prompt_embeds": tensor};
            docs/prompt_embeds.md). An unknown argument is a TypeError
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
        "prompt_token_ids", with enable_prompt_embeds vLLM's EmbedsPrompt
        {"prompt_embeds": tensor [num_tokens, hidden_size]} (docs/prompt_embeds.md),
        or a list of any of these. sampling_params: one for all
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
        params_list = self._pooling_params_list(prompts, pooling_params, truncate_prompt_tokens, "embed")
        return [EmbeddingRequestOutput.from_base(output)
                for output in self._run_pooling(_as_prompt_list(prompts), params_list, use_tqdm)]

    def classify(self, prompts: PromptType | SequenceABC[PromptType], *, truncate_prompt_tokens: int | None = None,
                 use_tqdm: bool = True, pooling_params: PoolingParams | SequenceABC[PoolingParams] | None = None
                 ) -> list[ClassificationRequestOutput]:
        """The class probabilities of each prompt, in prompt order (vLLM's LLM.classify):
        `outputs.probs`, the classifier's logits at the prompt's last token through its
        activation (softmax over the labels, sigmoid for one; PoolingParams(use_activation=
        False) keeps the logits). Needs a sequence classifier (`*ForSequenceClassification`,
        which runner='auto' pools). prompts and the rest as in `embed`."""
        params_list = self._pooling_params_list(prompts, pooling_params, truncate_prompt_tokens, "classify")
        return [ClassificationRequestOutput.from_base(output)
                for output in self._run_pooling(_as_prompt_list(prompts), params_list, use_tqdm)]

    def reward(self, prompts: PromptType | SequenceABC[PromptType], /, *, truncate_prompt_tokens: int | None = None,
               use_tqdm: bool = True, pooling_params: PoolingParams | SequenceABC[PoolingParams] | None = None
               ) -> list[PoolingRequestOutput]:
        """Every token's reward of each prompt, in prompt order (vLLM's LLM.reward: the
        pooling task "token_classify"): `outputs.data` is a [num_prompt_tokens, num_labels]
        tensor, the classifier's head at each position through its activation (sigmoid for
        one label, softmax over two or more; PoolingParams(use_activation=False) keeps the
        logits). The last row is what LLM.classify returns. Needs a sequence classifier
        (`*ForSequenceClassification`, as reward models such as Skywork-Reward are). Such a
        prompt is computed whole: its cached prefix is not read. prompts and the rest as in
        `embed`."""
        params_list = self._pooling_params_list(prompts, pooling_params, truncate_prompt_tokens, "token_classify")
        return self._run_pooling(_as_prompt_list(prompts), params_list, use_tqdm)

    def score(self, data_1: PromptType | SequenceABC[PromptType], data_2: PromptType | SequenceABC[PromptType], /,
              *, truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
              pooling_params: PoolingParams | None = None,
              chat_template: str | None = None) -> list[ScoringRequestOutput]:
        """The score of each pair (vLLM's LLM.score): data_1 and data_2 are a text or a list
        of texts, paired 1-to-1, 1-to-N (the one text against each of the N) or N-to-N.

        A cross-encoder (a sequence classifier with one label) reads each pair as one prompt
        and scores it with its activated logit. chat_template (vLLM's score template: the
        Jinja text, e.g. examples/score_templates/qwen3_reranker.jinja's for Qwen3-Reranker)
        renders the pair as messages of roles "query" (the data_1 text) and "document" (the
        data_2 text) into the prompt the model was trained on; without one, the pair is
        tokenized as vLLM tokenizes it for a model without a score template (the tokenizer's
        text pair, or with config.json's use_pad_token false the two texts joined).
        truncate_prompt_tokens k cuts each prompt to k tokens (the tokenizer's truncation;
        -1: max_model_len). An embedding model embeds every text (as `embed`) and scores the
        cosine similarity of each pair's embeddings (chat_template plays no part).
        pooling_params: the cross-encoder's (use_activation) or the embeddings'."""
        texts_1, texts_2 = _score_inputs(data_1, data_2)
        task = self._check_pooling_task("score")
        if task == "score":
            return self._cross_encoding_score(texts_1, texts_2, truncate_prompt_tokens, use_tqdm, pooling_params,
                                              chat_template)
        embeddings = self._run_pooling(texts_1 + texts_2, self._pooling_params_list(
            texts_1 + texts_2, pooling_params, truncate_prompt_tokens, "embed"), use_tqdm)
        return embedding_scores(embeddings[:len(texts_1)], embeddings[len(texts_1):], self.get_tokenizer())

    def _cross_encoding_score(self, texts_1: list[PromptType], texts_2: list[PromptType],
                              truncate_prompt_tokens: int | None, use_tqdm: bool,
                              pooling_params: PoolingParams | None,
                              score_template: str | None) -> list[ScoringRequestOutput]:
        if len(texts_1) == 1:
            texts_1 = texts_1 * len(texts_2)
        if any(not isinstance(text, str) for text in texts_1 + texts_2):
            raise ValueError("A cross-encoder scores pairs of texts: give data_1 and data_2 as strings.")
        model_config = self.llm_engine.model_config
        check_truncate_prompt_tokens(truncate_prompt_tokens)
        truncated_prompt([], truncate_prompt_tokens, model_config.max_model_len)  # within the context
        prompts = [cross_encoder_prompt(self.get_tokenizer(), model_config.hf_config, text_1, text_2,
                                        truncate_prompt_tokens, model_config.max_model_len, score_template)
                   for text_1, text_2 in zip(texts_1, texts_2)]
        params = self._pooling_params_list(prompts, pooling_params, None, "score")
        return [ScoringRequestOutput.from_base(output) for output in self._run_pooling(prompts, params, use_tqdm)]

    def _check_pooling_task(self, task: str) -> str:
        """The pooling task `LLM.<task>` runs on this engine's model; a model that does not
        serve it is a ValueError saying what it serves (vLLM's messages)."""
        model_config = self.llm_engine.model_config
        if not model_config.is_pooling:
            raise ValueError(f"LLM.{task} needs a pooling model: start the LLM with runner='pooling' "
                             f"(vLLM's --runner pooling, or the older task='embed'), or on a sequence classifier "
                             f"with runner='auto'.")
        supported = model_config.supported_pooling_tasks
        if task == "score":
            if "score" in supported or "embed" in supported:
                return "score" if "score" in supported else "embed"
            raise ValueError(f"Score API is only enabled for num_labels == 1 (this classifier has "
                             f"{model_config.hf_config.num_labels} labels); LLM.classify serves it.")
        if task not in supported:
            method = "reward" if task == "token_classify" else task
            serving = " and ".join(f"LLM.{'reward' if t == 'token_classify' else t}" for t in supported)
            raise ValueError(f"LLM.{method} needs a model that serves the pooling task {task!r}; this "
                             f"one serves {serving}.")
        return task

    def encode(self, prompts: PromptType | SequenceABC[PromptType],
               pooling_params: PoolingParams | SequenceABC[PoolingParams] | None = None, *,
               truncate_prompt_tokens: int | None = None, use_tqdm: bool = True) -> list[PoolingRequestOutput]:
        """The pooled vector of each prompt as a tensor (vLLM's LLM.encode); as `embed`."""
        params_list = self._pooling_params_list(prompts, pooling_params, truncate_prompt_tokens, None)
        return self._run_pooling(_as_prompt_list(prompts), params_list, use_tqdm)

    def _pooling_params_list(self, prompts: Any, pooling_params: Any, truncate_prompt_tokens: int | None,
                             task: str | None) -> list[PoolingParams]:
        """One PoolingParams per prompt, of `task` (None: the model's own, or the params')."""
        if not self.llm_engine.is_pooling:
            raise ValueError("LLM.embed and LLM.encode need a pooling model: start the LLM with runner='pooling' "
                             "(vLLM's --runner pooling, or the older task='embed').")
        if task is not None:
            self._check_pooling_task(task)
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
        if task is not None:
            for params in params_list:
                if params.task not in (None, task):
                    raise ValueError(f"pooling_params task {params.task!r} does not match LLM.{task} "
                                     f"(task {task!r}).")
            params_list = [dataclasses.replace(params, task=task) for params in params_list]
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
        (or `chat_template`). messages: one conversation or a list of them. A vision-language
        model takes images as vLLM's LLM.chat does: `image_url` parts holding a data URL, or
        `image_pil` parts holding a PIL image."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer = self.get_tokenizer()
        prompts: list[PromptType] = []
        for conversation in conversations:
            conversation, images = split_chat_images(conversation)
            text = tokenizer.apply_chat_template(
                conversation, chat_template=chat_template, tokenize=False,
                add_generation_prompt=add_generation_prompt and not continue_final_message,
                continue_final_message=continue_final_message)
            check_unicode(text, "messages")
            # The template already holds any BOS it wants: do not add special tokens again.
            prompt = {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}
            if images:
                prompt["multi_modal_data"] = {"image": images}
            prompts.append(prompt)
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

    # ---- sleep mode and weight updates (RLHF; docs/sleep_mode.md) --------------------------
    def sleep(self, level: int = 1) -> None:
        """Puts the engine to sleep (vLLM's; needs enable_sleep_mode=True): level 1 frees the
        KV cache and offloads the weights to host memory, level 2 discards the weights too
        (reload them with `collective_rpc("reload_weights")` or load new ones with
        `collective_rpc("load_weights", args=(weights,))` after `wake_up(tags=["weights"])`).
        The prefix cache is reset; requests still unfinished are aborted. On a CPU device
        the weights are host memory already and stay (only the KV cache is freed). Requests
        sent while asleep raise EngineSleepingError."""
        self.llm_engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restores what `sleep` freed: tags "weights" and / or "kv_cache" (None: both).
        Waking the weights first lets a trainer load new ones before the KV cache takes
        its memory back."""
        self.llm_engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        """True from `sleep` until every freed tag is woken up."""
        return self.llm_engine.is_sleeping()

    def reset_prefix_cache(self) -> bool:
        """Forgets the prefix cache (after a weight update, its KV is the old weights');
        False while requests hold blocks."""
        return self.llm_engine.reset_prefix_cache()

    def collective_rpc(self, method: Any, timeout: float | None = None, args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        """Runs `method` on every worker (vLLM's): a Worker method's name, e.g.
        "reload_weights" or "load_weights" (args=(iterable of (name, tensor),): full
        checkpoint tensors under Hugging Face names, each rank's `weight_loader` cuts its
        shard), a method of worker_extension_cls, or a function called as
        `function(worker, *args, **kwargs)`. Returns the results in rank order."""
        return self.llm_engine.collective_rpc(method, timeout, args, kwargs)

    def shutdown(self) -> None:
        """Releases the workers (Ray actors and placement group, when used)."""
        self.llm_engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _score_inputs(data_1: Any, data_2: Any) -> tuple[list[PromptType], list[PromptType]]:
    """Both sides of LLM.score as lists, paired as vLLM allows: 1-to-1, 1-to-N or N-to-N."""
    texts_1, texts_2 = _as_prompt_list(data_1), _as_prompt_list(data_2)
    if not texts_1:
        raise ValueError("At least one text element must be given (data_1 is empty).")
    if not texts_2:
        raise ValueError("At least one text_pair element must be given (data_2 is empty).")
    if len(texts_1) > 1 and len(texts_1) != len(texts_2):
        raise ValueError(f"Input lengths must be either 1:1, 1:N or N:N; got {len(texts_1)}:{len(texts_2)}.")
    return texts_1, texts_2


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

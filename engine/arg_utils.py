"""`EngineArgs`: the one place where engine settings, their defaults and help live.

Its fields are the keyword arguments of `LLM(...)`; `add_cli_args` turns the same fields
into the flags of `raylm serve` / `raylm bench`, `from_values` reads them as Ray Serve app
keys, and `docs/engine_args.md` is generated from them, so no setting is spelled twice.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
from dataclasses import dataclass, field
from typing import Any

from raylm.engine import envs
from raylm.engine.arg_fields import SettingsMixin, setting
from raylm.engine.config import (LOAD_FORMATS, LOGPROBS_MODES, SCHEDULING_POLICIES, CacheConfig, DeviceConfig,
                                 EngineConfig, LoRAConfig, ModelConfig, ParallelConfig, PoolerConfig, SchedulerConfig,
                                 check_load_format, default_max_num_batched_tokens, derive_max_model_len,
                                 load_hf_config, resolve_dtype, sentence_transformers_pooling, visible_gpu)
from raylm.engine.generation_config import check_override_generation_config
from raylm.engine.hf_overrides import apply_hf_overrides, parse_hf_overrides
from raylm.engine.logits_processor_classes import resolve_logits_processors
from raylm.engine.tokenizer import get_tokenizer
from raylm.engine.multimodal.processor import check_limit_mm_per_prompt, image_feature_size
from raylm.engine.usage_context import UsageContext
from raylm.kernels.kv_cache_dtype import KV_CACHE_DTYPES, check_kv_cache_dtype
from raylm.engine.spec_decode.config import (EAGLE_HEAD_ARCHITECTURES, SpeculativeConfig, build_speculative_config,
                                             parse_speculative_config)
from raylm.models.bundled import DEMO_MODEL_NAME, resolve_model_path
from raylm.models.quantization import QUANTIZATION_METHODS, get_quant_config
from raylm.models.pipeline import check_pipeline_parallel
from raylm.models.registry import default_runner_type, resolve_model_class
from raylm.models.seq_cls_conversion import ScoreFromTokens, score_from_tokens
from raylm.models.sliding_window import kv_cache_sliding_window

_GiB = 1024**3

logger = logging.getLogger(__name__)


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass
class EngineArgs(SettingsMixin):
    setting_kind = "engine argument"

    model: str = field(default="", metadata=_help(f"Path of a Hugging Face model folder (config.json, "
                                                  f"*.safetensors, tokenizer files), or {DEMO_MODEL_NAME!r}; "
                                                  f"default: raylm's bundled demo model, {DEMO_MODEL_NAME!r}."))
    tokenizer: str | None = field(default=None, metadata=_help("Tokenizer folder; defaults to the model folder."))
    load_format: str = field(default="auto", metadata={"choices": LOAD_FORMATS, **_help(
        "How the weights are read (vLLM's flag): 'auto' and 'safetensors' read the model folder's *.safetensors "
        "files; 'dummy' reads none and gives every weight a random value, uniform in [-0.001, 0.001] (vLLM's range "
        "and seed, 1234, per parameter: the same every run, and each tensor-parallel rank draws its own shard so), "
        "to measure speed without the weights; config.json and the tokenizer are still read from the folder. "
        "Its outputs are meaningless. vLLM's other formats (pt, gguf, ...) are not read.")})
    quantization: str | None = field(default=None, metadata={"choices": QUANTIZATION_METHODS, **_help(
        "FP8 weights (vLLM's flag, docs/quantization.md): 'fp8' quantizes a 16/32-bit checkpoint's linear layers "
        "and MoE experts (not the embeddings, the LM head or MoE routers) to float8_e4m3fn at load, one scale per "
        "tensor, or reads a checkpoint "
        "whose config.json quantization_config has quant_method 'fp8' (per-tensor or block-wise); "
        "'compressed-tensors' reads llm-compressor's FP8 checkpoints (per-tensor, per-channel or block-wise) "
        "and its W4A16 / W8A16 integer ones (format 'pack-quantized', dense and MoE), read as GPTQ weights. "
        "Default: what the checkpoint's quantization_config says, else none. GPUs of compute capability 8.9 and up "
        "multiply in fp8 (W8A8, activations quantized per token or by the checkpoint's static scale); CPUs and older "
        "GPUs dequantize each layer's weight in chunks as they multiply (W8A16). Weights stay in fp8 in memory. "
        "MoE experts dequantize a chunk of experts at a time on CPU and CUDA (no fp8 grouped GEMM). "
        "'gptq' and 'awq' read GPTQ (4 or 8-bit) and AWQ (4-bit GEMM) checkpoints, dense and MoE; the weights stay "
        "packed: CPUs multiply them with a native kernel over a repacked copy, CUDA dequantizes them in chunks (no "
        "Marlin kernel); MoE experts dequantize a chunk of experts at a time, as FP8 ones do.")})
    tokenizer_mode: str = field(default="auto", metadata=_help("'auto' uses the fast tokenizer, 'slow' the "
                                                               "Python one."))
    skip_tokenizer_init: bool = field(default=False, metadata=_help("Load no tokenizer: prompts must be token "
                                                                    "ids and outputs carry no text."))
    trust_remote_code: bool = field(default=False, metadata=_help("Allow code from the model folder."))
    revision: str | None = field(default=None, metadata=_help("Model revision (for hub-style folders)."))
    dtype: str = field(default="auto", metadata=_help("Weights and activations dtype: auto, float32, float16, "
                                                      "bfloat16. 'auto' follows config.json (fp32 runs as "
                                                      "fp16 on GPUs)."))
    seed: int = field(default=0, metadata=_help("Seed of the global random state."))
    max_model_len: int | None = field(default=None, metadata=_help("Context length (prompt + output); defaults "
                                                                   "to the model's."))
    block_size: int = field(default=16, metadata=_help("Tokens per KV-cache block."))
    gpu_memory_utilization: float = field(default=0.9, metadata=_help("Fraction of GPU memory for weights, "
                                                                      "activations and KV cache."))
    kv_cache_space: float | None = field(default=None, metadata=_help(
        "CPU only: GiB of memory for the KV cache. Default: what max_num_seqs requests of max_model_len "
        "tokens can fill, at most 4 GiB."))
    kv_cache_dtype: str = field(default="auto", metadata={"choices": KV_CACHE_DTYPES, **_help(
        "Storage of the KV cache (vLLM's): 'auto' is the model's dtype; 'fp8' (= 'fp8_e4m3') and 'fp8_e5m2' store "
        "one byte an element, twice the blocks in the same memory, each layer's keys and values divided by its "
        "k_scale and v_scale (from the checkpoint, else 1.0) and rounded (docs/quantized_kv_cache.md).")})
    calculate_kv_scales: bool = field(default=False, metadata=_help(
        "vLLM's flag to estimate k_scale and v_scale from the first batch: not supported, True is an error "
        "(scales come from the checkpoint, else 1.0)."))
    num_gpu_blocks_override: int | None = field(default=None, metadata=_help("Use this many KV-cache blocks "
                                                                             "instead of measuring (tests)."))
    max_num_seqs: int = field(default=256, metadata=_help("Most sequences in one batch."))
    max_num_batched_tokens: int | None = field(default=None, metadata=_help(
        "Most tokens in one step (the step's token budget). Default with chunked prefill: 2048 on the CPU; on a "
        "GPU vLLM's, 8192 for `LLM` and 2048 for the server, or 16384 and 8192 on GPUs of 70 GiB or more other than "
        "the A100 (2048 for the engine classes used directly). Without chunked prefill: max(max_model_len, 2048)."))
    enable_chunked_prefill: bool = field(default=True, metadata=_help(
        "Split long prompts over several steps, so that decoding requests keep a token per step while they "
        "prefill."))
    disable_async_output_proc: bool = field(default=False, metadata=_help(
        "With Ray workers the driver turns one step's tokens into text (detokenizing, stop strings) while "
        "the workers run the next step; this turns that overlap off (vLLM's flag). With the overlap, a request "
        "that a stop string ends has computed one more token, which is dropped."))
    async_scheduling: bool = field(default=True, metadata=_help(
        "With Ray workers the driver schedules step k+1 while the workers run step k (vLLM's async "
        "scheduling): each decoding request's next token is a placeholder that the workers fill with the token "
        "they sampled, so they start the next step as soon as one ends and the driver's Python (scheduling, "
        "applying tokens, detokenizing) runs beside the forward. A request that stops (EOS, stop token, stop "
        "string) has computed one more token, which is dropped. In process on a GPU the worker's step thread does "
        "the same, and launches step k+1 on the device's copy of step k's tokens before reading them; on the CPU "
        "in process it has no effect. With pipeline_parallel_size P "
        "above 1 it keeps up to P + 1 micro-batches of different requests in flight instead (off: one batch at a "
        "time)."))
    scheduling_policy: str = field(default="fcfs", metadata=setting(
        "How the scheduler orders requests (vLLM's flag). 'fcfs': first come, first served; when KV blocks run "
        "out the latest admitted request is preempted. 'priority': each request's priority (an integer, lower "
        "first; LLM.generate's priority=, the server's `priority` field) orders the waiting queue, ties by "
        "arrival, and when blocks run out the running request of the worst priority (the latest among equals) is "
        "preempted. A non-zero priority under 'fcfs' is an error (docs/architecture.md).", choices=SCHEDULING_POLICIES))
    enable_prefix_caching: bool = field(default=True, metadata=_help(
        "Keep the KV of full blocks after their request ends and reuse it for prompts with the same prefix."))
    tensor_parallel_size: int = field(default=1, metadata=_help("Number of tensor-parallel workers."))
    pipeline_parallel_size: int = field(default=1, metadata=_help(
        "Number of pipeline stages (vLLM's flag): pipeline_parallel_size x tensor_parallel_size Ray workers, each "
        "stage a tensor-parallel group on one node holding a contiguous share of the layers (the first the "
        "embedding, the last the final norm and LM head) and the KV cache of those layers only. With async "
        "scheduling up to pipeline_parallel_size + 1 micro-batches of the running requests are in flight, so "
        "that every stage works at once; without it one batch at a time. Llama-family models (Llama, Mistral, "
        "Qwen2, Qwen3, their MoE variants, Gemma 2 and 3, OLMo 2, Phi-3, Granite)."))
    enable_expert_parallel: bool = field(default=False, metadata=_help(
        "MoE models: place whole experts on the tensor-parallel workers (expert parallelism over the same "
        "workers, vLLM's flag) instead of sharding every expert's MLP across them. Each worker runs its experts "
        "for all tokens and one all-reduce per MoE layer sums them, as without it. Needs at least as many experts "
        "as workers; no effect on other models or at tensor_parallel_size 1."))
    distributed_executor_backend: str | None = field(default=None, metadata=_help(
        "'uni' runs the one worker in this process; 'ray' runs the workers as Ray actors, even one. Default: "
        "'uni' for one worker, 'ray' for more (tensor_parallel_size or pipeline_parallel_size above 1). "
        "('mp', vLLM's multiprocessing executor, does not exist in raylm.)"))
    ray_compiled_graph: bool = field(default=True, metadata=_help(
        "Ray: send each step to the workers through a Ray compiled graph (shared-memory channels set up once; "
        "falls back to actor calls, with a warning, where it cannot be built); off sends one actor call per "
        "worker and step. The graph's readers poll their channels (Ray 2.60 yields in a loop), so each worker "
        "keeps a CPU core busy between steps, even when idle: on CPU-only machines with fewer cores than "
        "workers + 1, turning it off can give more throughput."))
    ray_span_nodes: bool = field(default=False, metadata=_help("Ray: let the workers span several nodes "
                                                               "(placement strategy PACK); by default they "
                                                               "must fit on one node (STRICT_PACK)."))
    ray_cpus_per_worker: float = field(default=0.5, metadata=_help("Ray on CPU: CPUs each worker's placement "
                                                                   "bundle reserves (fractions share a core)."))
    placement_group_timeout_s: float = field(default=60.0, metadata=_help("Ray: seconds to wait for the "
                                                                          "workers' placement group before "
                                                                          "failing with what the cluster "
                                                                          "has."))
    worker_timeout_s: float = field(default=600.0, metadata=_help("Ray: seconds one worker call (model load, "
                                                                  "a step, a collective) may take before the "
                                                                  "workers are declared hung."))
    device: str = field(default="auto", metadata=_help("'auto', 'cuda' or 'cpu'."))
    attention_backend: str | None = field(default=None, metadata=_help("Attention kernels: 'triton', 'cpu' (native "
                                                                       "C++ decode) or 'torch' (reference); default "
                                                                       "triton on CUDA, cpu on CPU."))
    enforce_eager: bool = field(default=False, metadata=_help(
        "Run every step eagerly (vLLM's flag). By default, on a GPU with the Triton kernels and one worker, "
        "decode steps replay CUDA graphs captured at start for padded batch sizes 1, 2, 4, 8, 16, 24, ... up "
        "to max_num_seqs (their memory is set aside before the KV cache is sized); steps with a prompt chunk "
        "always run eagerly. No effect on the CPU."))
    disable_log_stats: bool = field(default=False, metadata=_help("Do not log throughput statistics."))
    generation_config: str = field(default="auto", metadata=_help(
        "'auto' applies the model's generation_config.json: its sampling fields (temperature, top_p, top_k, "
        "min_p, repetition_penalty, max_new_tokens) are the defaults of requests that leave them unset; 'vllm' "
        "keeps vLLM's defaults instead; a folder path reads the file from there. All the file's EOS ids stop "
        "generation either way, as in vLLM."))
    override_generation_config: dict[str, Any] | None = field(default=None, metadata=_help(
        "generation_config.json sampling fields (a JSON object on the command line, e.g. {\"temperature\": 0.5}) "
        "merged over the file's under generation_config 'auto' or a folder, or used alone under 'vllm', as "
        "vLLM's flag; keys: temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens. Default: "
        "none."))
    speculative_config: dict[str, Any] | None = field(default=None, metadata=_help(
        "Speculative decoding, as vLLM's: a dict (a JSON object on the command line), "
        "{\"method\": \"ngram\", \"num_speculative_tokens\": k, \"prompt_lookup_max\": n, \"prompt_lookup_min\": m} "
        "to propose the tokens that followed the request's last n..m tokens earlier in its prompt and output, "
        "or {\"model\": DIR, \"num_speculative_tokens\": k} for a smaller draft model with the same "
        "vocabulary, or {\"method\": \"eagle\", \"model\": DIR, \"num_speculative_tokens\": k} for an EAGLE-1 "
        "head over a Llama-family target. The target model verifies the k proposals in one step; outputs "
        "follow its distribution exactly. Also: disable_by_batch_size, adaptive, draft_token_cost "
        "(docs/speculative_decoding.md). Default: off. Not with pipeline_parallel_size above 1."))
    max_logprobs: int = field(default=20, metadata=_help(
        "Most logprobs (and prompt_logprobs; chat: top_logprobs) one request may ask for, as vLLM's flag; -1 "
        "allows up to the vocabulary size. Beam search asks for 2 x beam_width of them per step (more for models "
        "with several EOS ids), so this also bounds the beam width (10 by default)."))
    logprobs_mode: str = field(default="raw_logprobs", metadata={"choices": LOGPROBS_MODES, **_help(
        "What the logprobs of sampled tokens and their top alternatives hold, as vLLM V1's flag: 'raw_logprobs' "
        "the log-softmax of the model's logits, before any sampling parameter acts on them; 'raw_logits' those "
        "logits themselves; 'processed_logprobs' / 'processed_logits' the same after allowed_token_ids, "
        "bad_words, logit_bias, min_tokens and the penalties and, for rows that sample (temperature > 0), "
        "temperature, min_p, top_k and top_p (the tokens they cut at -inf). Prompt logprobs stay raw log-softmax. "
        "Not with a draft model (speculative_config's model).")})
    logits_processors: list[str] | None = field(default=None, metadata=_help(
        "Custom logits processors, as vLLM v1's: classes subclassing raylm.engine.logits_processor.LogitsProcessor "
        "(vLLM's interface, ported by changing its import), named 'package.module:Class' or 'package.module.Class' "
        "(LLM also takes the classes themselves). The worker that samples builds one of each at start and runs "
        "them on every step's batch; requests pass them settings in SamplingParams.extra_args (the server's "
        "vllm_xargs). Default: none. Not with speculative decoding or pooling models (docs/logits_processors.md)."))
    enable_lora: bool = field(default=False, metadata=_help(
        "Serve LoRA adapters (PEFT format) over the base model: requests name an adapter (LoRARequest, or the "
        "server's model name), and one batch mixes the base model and up to max_loras adapters. Not with "
        "pipeline_parallel_size above 1."))
    enable_sleep_mode: bool = field(default=False, metadata=_help(
        "Allow LLM.sleep / wake_up (vLLM's flag, for RLHF): sleep level 1 frees the KV cache and offloads the "
        "weights to host memory (on a CPU device they stay where they are), level 2 discards the weights too, to "
        "be reloaded or updated before generating again (docs/sleep_mode.md)."))
    worker_extension_cls: str = field(default="", metadata=_help(
        "A class, as 'module.Class', whose methods every worker gains (vLLM's flag), to be called through "
        "LLM.collective_rpc: how an RLHF trainer pushes new weights into the running model."))
    max_loras: int = field(default=1, metadata=_help(
        "LoRA: most adapters in one batch (the workers' adapter slots); requests of other adapters wait for a "
        "slot."))
    max_lora_rank: int = field(default=16, metadata=_help(
        "LoRA: the largest adapter rank accepted; every slot is this wide, so set it to your adapters' rank."))
    max_cpu_loras: int | None = field(default=None, metadata=_help(
        "LoRA: most adapters kept loaded in host memory (least recently used ones are dropped and read again "
        "when needed); at least max_loras. Default: max_loras."))

    runner: str = field(default="auto", metadata=_help(
        "vLLM's model runner: 'generate' samples tokens (LLM.generate, the completions and chat routes); "
        "'pooling' turns each prompt into one vector (LLM.embed, /v1/embeddings) from the final norm's hidden "
        "states, pooled as pooler_config says; 'auto' picks as vLLM does: 'pooling' for a model folder with "
        "sentence-transformers pooling files (modules.json listing a Pooling module) or a config.json whose "
        "architectures name a bare decoder (LlamaModel, MistralModel, Qwen2Model, Qwen3Model, ...: an embedding "
        "checkpoint without an LM head) or a sequence classifier (LlamaForSequenceClassification, "
        "Qwen2ForSequenceClassification, Qwen3ForSequenceClassification, MistralForSequenceClassification: "
        "LLM.classify, LLM.score, /classify, /score, /rerank), 'generate' otherwise."))
    task: str | None = field(default=None, metadata=_help(
        "vLLM's older spelling of runner: 'embed' (or 'embedding'), 'classify' and 'score' are runner 'pooling', "
        "'generate' is runner 'generate'."))
    limit_mm_per_prompt: dict[str, int] | None = field(default=None, metadata=_help(
        "Vision-language models: the most items of each modality one prompt may carry, as vLLM's flag (a JSON "
        "object on the command line), e.g. {\"image\": 2}; default one image, at most 16 (each image is a vision "
        "tower forward and its pixels travel with the request). Ignored for text-only models."))
    enable_prompt_embeds: bool = field(default=False, metadata=_help(
        "Accept prompts given as embeddings instead of token ids, as vLLM's flag: LLM.generate's "
        "{\"prompt_embeds\": tensor [num_tokens, hidden_size]}, the completions route's `prompt_embeds` (base64 "
        "of torch.save(tensor)). The model reads them in place of its embedding table's rows at the prompt's "
        "positions. Off, such prompts are refused (400 on the server): the embeddings reach the model's layers "
        "unchecked but for shape and finiteness. Causal LMs of the Llama family (not pooling, vision-language, "
        "speculative decoding or pipeline_parallel_size above 1); docs/prompt_embeds.md."))
    hf_overrides: dict[str, Any] | None = field(default=None, metadata=_help(
        "Keys written over the model's Hugging Face config after config.json is read, as vLLM's flag (a JSON "
        "object on the command line): each replaces the attribute of its name or adds it; a dict naming a nested "
        "config (a vision-language model's text_config) is merged into it. Values keep the kind the config holds "
        "(a number stays a number, ...). What it is for: loading a checkpoint as another architecture, e.g. a "
        "causal LM as a reranker, {\"architectures\": [\"Qwen3ForSequenceClassification\"], "
        "\"classifier_from_token\": [\"no\", \"yes\"], \"is_original_qwen3_reranker\": true} for "
        "Qwen3-Reranker (docs/serving.md, Classification, scoring and reranking). Default: none."))
    pooler_config: dict[str, Any] | None = field(default=None, metadata=_help(
        "runner 'pooling': how hidden states become the embedding, as vLLM's PoolerConfig (a JSON object on the "
        "command line): {\"pooling_type\": \"LAST\" | \"MEAN\" | \"CLS\", \"normalize\": true | false}; "
        "default LAST, normalized (what decoder embedding models such as Qwen3-Embedding and e5-mistral use), "
        "or what the model folder's sentence-transformers files say (1_Pooling/config.json's pooling_mode_*, "
        "normalized where modules.json lists a Normalize module); the keys given here override those. "
        "MEAN and CLS need the whole prompt in one step, so they turn chunked prefill and prefix caching off."))

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineArgs":
        """Builds EngineArgs, naming unknown keyword arguments (and near misses) in the error."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            hints = []
            for name in unknown:
                close = difflib.get_close_matches(name, known, n=1)
                hints.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
            raise TypeError(f"Unknown engine argument(s): {', '.join(hints)}.")
        return cls(**kwargs)

    def create_engine_config(self, usage_context: UsageContext = UsageContext.ENGINE_CONTEXT) -> EngineConfig:
        """The engine's configuration; `usage_context` (who builds the engine) picks the
        default step token budget on a GPU, as in vLLM."""
        envs.check_all()  # a bad RAYLM_* value stops the start here, before anything is loaded
        check_kv_cache_dtype(self.kv_cache_dtype)
        if self.calculate_kv_scales:
            raise ValueError("calculate_kv_scales=True is not supported: raylm takes k_scale and v_scale from the "
                             "checkpoint, else 1.0 (docs/quantized_kv_cache.md).")
        # The one place a model argument is resolved: no model, or the demo model's short
        # name, means the bundled demo model's folder (for LLM, `raylm serve` and `raylm bench`).
        self.model = resolve_model_path(self.model)
        device_config = DeviceConfig.detect(self.device)
        hf_config = self._hf_config(self.model)
        quant_config = get_quant_config(hf_config, self.quantization)  # errors before any weight is read
        runner_type, pooler_config = self._runner_and_pooler_config(hf_config)
        # A multi-modal config's context length is its language model's (vLLM's hf_text_config).
        text_config = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        max_model_len = derive_max_model_len(text_config, self.max_model_len)
        model_config = ModelConfig(
            model=self.model,
            tokenizer=self.tokenizer or self.model,
            dtype=resolve_dtype(self.dtype, hf_config, device_config.device),
            max_model_len=max_model_len,
            hf_config=hf_config,
            seed=self.seed,
            trust_remote_code=self.trust_remote_code,
            revision=self.revision,
            tokenizer_mode=self.tokenizer_mode,
            skip_tokenizer_init=self.skip_tokenizer_init,
            attention_backend=self.attention_backend,
            generation_config=self.generation_config,
            override_generation_config=check_override_generation_config(self.override_generation_config) or None,
            max_logprobs=self.max_logprobs,
            logprobs_mode=self.logprobs_mode,
            enforce_eager=self.enforce_eager,
            runner_type=runner_type,
            pooler_config=pooler_config,
            load_format=check_load_format(self.load_format),
            quantization=None if quant_config is None else quant_config.method,
            enable_sleep_mode=self.enable_sleep_mode,
            limit_mm_per_prompt=check_limit_mm_per_prompt(self.limit_mm_per_prompt),
            logits_processors=resolve_logits_processors(self.logits_processors),
            enable_prompt_embeds=self.enable_prompt_embeds,
        )
        if model_config.pooling_task == "classify":
            model_config.score_from_tokens = self._score_from_tokens(hf_config, model_config)
        enable_chunked_prefill, enable_prefix_caching = self.enable_chunked_prefill, self.enable_prefix_caching
        if model_config.is_pooling:
            enable_chunked_prefill, enable_prefix_caching = self._pooling_scheduling(model_config.pooler_config)
        parallel_config = ParallelConfig(
            tensor_parallel_size=self.tensor_parallel_size,
            pipeline_parallel_size=self.pipeline_parallel_size,
            enable_expert_parallel=self.enable_expert_parallel,
            distributed_executor_backend=self.distributed_executor_backend,
            ray_compiled_graph=self.ray_compiled_graph,
            ray_span_nodes=self.ray_span_nodes,
            ray_cpus_per_worker=self.ray_cpus_per_worker,
            placement_group_timeout_s=self.placement_group_timeout_s,
            worker_timeout_s=self.worker_timeout_s,
            worker_extension_cls=self.worker_extension_cls,
        )
        if parallel_config.pipeline_parallel_size > 1:
            check_pipeline_parallel(hf_config, parallel_config.pipeline_parallel_size)
        speculative_config = _speculative_config(self.speculative_config, model_config, parallel_config)
        _check_logits_processors(model_config, speculative_config)
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode (--logprobs-mode) must be one of {', '.join(LOGPROBS_MODES)}, got "
                             f"{self.logprobs_mode!r}.")
        if speculative_config is not None and speculative_config.uses_draft_model \
                and self.logprobs_mode != "raw_logprobs":
            # The rejection sampler scores a draft's proposals from the raw logprobs alone.
            raise ValueError(f"logprobs_mode (--logprobs-mode) {self.logprobs_mode!r} is not supported with a draft "
                             f"model (speculative_config's model); use 'raw_logprobs' or n-gram proposals.")
        # A draft model keeps its KV under the target's block ids: a block may be freed as
        # the window slides only once every layer of both models has passed it. The draft's
        # first query of a step may be the accepted proposal its KV lacks, one position
        # before the target's first new token, so its window reaches one token further back.
        sliding_window = kv_cache_sliding_window(model_config.layer_sliding_windows)
        if speculative_config is not None and speculative_config.uses_draft_model:
            sliding_window = kv_cache_sliding_window(model_config.layer_sliding_windows
                                                     + speculative_config.draft_model_config.layer_sliding_windows)
            sliding_window = None if sliding_window is None else sliding_window + 1
        cache_config = CacheConfig(
            block_size=self.block_size,
            gpu_memory_utilization=self.gpu_memory_utilization,
            cpu_kv_cache_space_bytes=None if self.kv_cache_space is None else int(self.kv_cache_space * _GiB),
            num_gpu_blocks_override=self.num_gpu_blocks_override,
            enable_prefix_caching=enable_prefix_caching,
            sliding_window=sliding_window,
            cache_dtype=self.kv_cache_dtype,
        )
        max_num_batched_tokens = self.max_num_batched_tokens or default_max_num_batched_tokens(
            device_config.device, usage_context, enable_chunked_prefill, max_model_len,
            visible_gpu() if device_config.device == "cuda" else None)
        if model_config.is_pooling:
            _check_whole_prompt_budget(model_config.pooler_config, max_num_batched_tokens, max_model_len)
        scheduler_config = SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_chunked_prefill=enable_chunked_prefill,
            disable_async_output_proc=self.disable_async_output_proc,
            async_scheduling=self.async_scheduling,
            pipeline_parallel_size=self.pipeline_parallel_size,
            policy=self.scheduling_policy,
            disable_chunked_mm_input=model_config.has_bidirectional_image_attention,
        )
        lora_config = (LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras) if self.enable_lora
                       else None)
        _check_lora_with_speculative(lora_config, speculative_config)
        if lora_config is not None and parallel_config.pipeline_parallel_size > 1:
            # The stages before the last hand every row on, while the LoRA layers map their
            # rows to the step's output rows; the two are not combined (yet).
            raise ValueError(f"enable_lora is not supported with pipeline_parallel_size "
                             f"{parallel_config.pipeline_parallel_size}: use pipeline_parallel_size 1 to serve LoRA "
                             f"adapters, or turn LoRA off.")
        if model_config.is_pooling:
            _check_pooling_features(lora_config, speculative_config, parallel_config)
        if model_config.enable_prompt_embeds:
            _check_prompt_embeds_features(model_config, parallel_config, speculative_config)
        if model_config.is_multimodal:
            _check_multimodal_features(model_config, lora_config, speculative_config)
            _check_whole_image_budget(model_config, scheduler_config)
        return EngineConfig(model_config, cache_config, scheduler_config, parallel_config, device_config,
                            speculative_config, lora_config)

    def caches_prefixes(self) -> bool:
        """Whether the engine these arguments build caches prefixes, known without building
        it (a pooling engine's MEAN or CLS pooling turns caching off): what the Serve app's
        router asks before keying requests. Reads the model folder's config files."""
        if not self.enable_prefix_caching:
            return False
        model = resolve_model_path(self.model)
        hf_config = self._hf_config(model)
        _, pooler_config = self._runner_and_pooler_config(hf_config, model)
        return pooler_config is None or pooler_config.supports_chunked_prefill

    def _hf_config(self, model: str) -> Any:
        """The model folder's config.json with hf_overrides written over it."""
        hf_config = load_hf_config(model, self.trust_remote_code, self.revision)
        apply_hf_overrides(hf_config, self.hf_overrides)
        if "architectures" in parse_hf_overrides(self.hf_overrides):
            # Checked here, before the workers would find it: the name is the user's, not the file's.
            try:
                resolve_model_class(hf_config.architectures, "pooling")
            except ValueError as error:
                raise ValueError(f"hf_overrides['architectures'] {hf_config.architectures!r} name no supported "
                                 f"model: {str(error).split('; ', 1)[-1]}") from None
        return hf_config

    def _score_from_tokens(self, hf_config: Any, model_config: ModelConfig) -> ScoreFromTokens | None:
        """A causal LM read as a sequence classifier (hf_overrides' classifier_from_token and
        method, models/seq_cls_conversion.py): its tokens looked up in the tokenizer now, so
        that a wrong one fails before any weight is read."""
        architecture = next(arch for arch in hf_config.architectures if arch.endswith("ForSequenceClassification"))
        return score_from_tokens(hf_config, architecture, lambda: get_tokenizer(
            model_config.tokenizer, self.trust_remote_code, self.revision, self.tokenizer_mode))

    def _runner_and_pooler_config(self, hf_config: Any, model: str | None = None) -> tuple[str, PoolerConfig | None]:
        """The runner type and, for 'pooling', its PoolerConfig: pooler_config over the
        model folder's sentence-transformers pooling files (vLLM's order)."""
        pooling_files = sentence_transformers_pooling(model or self.model)
        runner_type = self._runner_type(getattr(hf_config, "architectures", None), pooling_files is not None)
        if runner_type != "pooling":
            if self.pooler_config is not None:
                raise ValueError("pooler_config applies to runner='pooling' only; this engine runs "
                                 "runner='generate'.")
            return runner_type, None
        defaults, source = pooling_files or (None, None)
        return runner_type, PoolerConfig.from_value(self.pooler_config, defaults, source)

    def _runner_type(self, architectures: list[str] | None, has_pooling_files: bool) -> str:
        """runner, or the older task, resolved to 'generate' or 'pooling'; 'auto' as vLLM
        resolves it (sentence-transformers pooling files, then the architecture's name)."""
        requested = self._requested_runner()
        model_default = default_runner_type(architectures)
        if requested == "auto":
            return "pooling" if has_pooling_files else model_default
        if requested == "generate" and model_default == "pooling":
            raise ValueError(f"config.json architectures {architectures!r} name a model without an LM head (an "
                             f"embedding checkpoint or a sequence classifier), which cannot generate: run it with "
                             f"runner='pooling' (or 'auto').")
        return requested

    def _requested_runner(self) -> str:
        """'auto', 'generate' or 'pooling', from runner or the older task."""
        if self.runner not in _RUNNERS:
            raise ValueError(f"runner must be one of {', '.join(_RUNNERS)}, got {self.runner!r}.")
        if self.task is None or self.task == "auto":
            return self.runner
        if self.task not in _TASK_RUNNERS:
            raise ValueError(f"task must be one of {', '.join(_TASK_RUNNERS)} (vLLM's older spelling of runner), got "
                             f"{self.task!r}.")
        if self.runner != "auto" and _TASK_RUNNERS[self.task] != self.runner:
            raise ValueError(f"task {self.task!r} and runner {self.runner!r} disagree: give runner alone.")
        return _TASK_RUNNERS[self.task]

    def _pooling_scheduling(self, pooler_config: PoolerConfig) -> tuple[bool, bool]:
        """(enable_chunked_prefill, enable_prefix_caching) of a pooling engine: MEAN and CLS
        pool rows that a chunk or a cache hit would skip, so both go off (vLLM does the same);
        LAST reads only the prompt's last row and keeps them."""
        if pooler_config.supports_chunked_prefill:
            return self.enable_chunked_prefill, self.enable_prefix_caching
        if self.enable_chunked_prefill or self.enable_prefix_caching:
            logger.info("%s pooling pools every prompt row: chunked prefill and prefix caching are off.",
                        pooler_config.pooling_type)
        return False, False


_RUNNERS = ("auto", "generate", "pooling")
_TASK_RUNNERS = {"generate": "generate", "embed": "pooling", "embedding": "pooling", "classify": "pooling",
                 "score": "pooling"}


def _check_whole_prompt_budget(pooler_config: PoolerConfig, max_num_batched_tokens: int, max_model_len: int) -> None:
    """MEAN and CLS pooling prefill each prompt in one step (chunking is off for them, so the
    scheduler's own advice, to turn chunked prefill on, does not apply): the step's budget
    must hold the longest prompt."""
    if pooler_config.supports_chunked_prefill or max_num_batched_tokens >= max_model_len:
        return
    raise ValueError(f"pooler_config pooling_type {pooler_config.pooling_type} pools every token of a prompt, so each "
                     f"prompt is prefilled in one step (chunked prefill is off for it), but max_num_batched_tokens "
                     f"({max_num_batched_tokens}) is smaller than max_model_len ({max_model_len}): raise "
                     f"max_num_batched_tokens to at least {max_model_len}, lower max_model_len, or use pooling_type "
                     f"LAST, which prefills prompts in chunks.")


def _check_pooling_features(lora_config: LoRAConfig | None, speculative_config: SpeculativeConfig | None,
                            parallel_config: ParallelConfig) -> None:
    """What a pooling engine does not combine with (yet): each is refused by name."""
    if lora_config is not None:
        raise ValueError("enable_lora is not supported with runner='pooling' (yet): turn LoRA off.")
    if speculative_config is not None:
        raise ValueError("speculative_config has nothing to speed up with runner='pooling' (nothing is decoded): "
                         "drop it.")
    if parallel_config.pipeline_parallel_size > 1:
        raise ValueError(f"runner='pooling' is not supported with pipeline_parallel_size "
                         f"{parallel_config.pipeline_parallel_size} (yet): use tensor_parallel_size.")


def _check_logits_processors(model_config: ModelConfig, speculative_config: SpeculativeConfig | None) -> None:
    """Custom logits processors index one logits row per request: a verification's rows
    (several a request) and a pooling model's (no logits) have no such batch. vLLM refuses
    both too."""
    names = [entry.name for entry in model_config.logits_processors]
    if not names:
        return
    if speculative_config is not None:
        raise ValueError(f"logits_processors ({', '.join(names)}) are not supported with speculative decoding "
                         f"(speculative_config): a verification scores several rows per request. Turn one of the "
                         f"two off.")
    if model_config.is_pooling:
        raise ValueError(f"logits_processors ({', '.join(names)}) are not supported by pooling models (runner "
                         f"'pooling'), which sample no tokens.")


def _check_lora_with_speculative(lora_config: LoRAConfig | None, speculative_config: SpeculativeConfig | None) -> None:
    """A draft model has no adapters: its proposals would be the base model's while the
    target verifies under each request's adapter, so it is refused rather than served with
    proposals that are mostly rejected. N-gram proposals come from the request's own tokens
    and the adapter-carrying target verifies them (docs/lora.md)."""
    if lora_config is not None and speculative_config is not None and speculative_config.uses_draft_model:
        raise ValueError(f"enable_lora and a draft model in speculative_config ({speculative_config.model!r}) cannot "
                         f"be combined: the draft model carries no LoRA adapters. Use speculative_config "
                         f"{{\"method\": \"ngram\", ...}} with enable_lora, or turn LoRA off.")


def _speculative_config(value: dict[str, Any] | str | None, model_config: ModelConfig,
                        parallel_config: ParallelConfig) -> SpeculativeConfig | None:
    """The validated speculative_config, with the draft model's ModelConfig: the target's
    dtype and context length, and checks that it can stand in for the target."""
    raw = parse_speculative_config(value)
    if raw is None:
        return None
    if parallel_config.pipeline_parallel_size > 1:
        # Verification rolls back rejected tokens on the driver while later micro-batches
        # of the pipeline are already in flight; the two are not combined (yet).
        raise ValueError(f"speculative_config is not supported with pipeline_parallel_size "
                         f"{parallel_config.pipeline_parallel_size}: use pipeline_parallel_size 1 for "
                         f"speculative decoding, or drop speculative_config.")
    config = build_speculative_config(raw)
    if not config.uses_draft_model:
        return config
    try:
        draft_path = resolve_model_path(config.model)
        hf_config = load_hf_config(draft_path, model_config.trust_remote_code)
    except ValueError as error:
        raise ValueError(f"speculative_config {error}") from None
    if config.is_eagle:
        _check_eagle_head(config.model, hf_config, model_config)
    if hf_config.vocab_size != model_config.vocab_size:
        raise ValueError(f"speculative_config model {config.model!r} has a vocabulary of {hf_config.vocab_size} "
                         f"tokens, the target model {model_config.vocab_size}: a draft model must share the "
                         f"target's tokenizer.")
    draft_config = ModelConfig(model=draft_path, tokenizer=model_config.tokenizer, dtype=model_config.dtype,
                               max_model_len=derive_max_model_len(hf_config, None), hf_config=hf_config,
                               seed=model_config.seed, trust_remote_code=model_config.trust_remote_code,
                               skip_tokenizer_init=True, attention_backend=model_config.attention_backend,
                               generation_config="vllm", load_format=model_config.load_format)
    if draft_config.max_model_len < model_config.max_model_len:
        raise ValueError(f"speculative_config model {config.model!r} handles {draft_config.max_model_len} tokens of "
                         f"context, fewer than max_model_len ({model_config.max_model_len}): lower max_model_len "
                         f"or use a draft model with a longer context.")
    draft_config.max_model_len = model_config.max_model_len
    tp = parallel_config.tensor_parallel_size
    if draft_config.num_attention_heads % tp:
        raise ValueError(f"speculative_config model {config.model!r} has {draft_config.num_attention_heads} "
                         f"attention heads, not divisible by tensor_parallel_size {tp}: the draft model is "
                         f"sharded like the target.")
    config.draft_model_config = draft_config
    return config


# Targets whose final hidden states an EAGLE-1 head of Llama layers reads (raylm runs them
# all through `LlamaForCausalLM`'s forward).
EAGLE_TARGET_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


def _check_eagle_head(head: str, hf_config: Any, model_config: ModelConfig) -> None:
    """An EAGLE head must fit its target: a Llama-family target (the head reads its final
    hidden states and shares its embedding and LM head) and the same hidden size (its
    attention heads divisible by tensor_parallel_size: checked as for a draft model). Its
    config's `architectures` becomes plain Llama's: the head's own layers are Llama
    decoder layers."""
    target = (getattr(model_config.hf_config, "architectures", None) or ["?"])[0]
    if target not in EAGLE_TARGET_ARCHITECTURES:
        raise ValueError(f"speculative_config method 'eagle' needs a Llama-family target "
                         f"({', '.join(EAGLE_TARGET_ARCHITECTURES)}); the model is {target}. Use method 'ngram' "
                         f"or a draft model with it.")
    architectures = getattr(hf_config, "architectures", None) or ["LlamaForCausalLM"]
    if architectures[0] not in EAGLE_HEAD_ARCHITECTURES:
        raise ValueError(f"speculative_config model {head!r} is a {architectures[0]}, not an EAGLE-1 head "
                         f"({', '.join(EAGLE_HEAD_ARCHITECTURES)}).")
    if hf_config.hidden_size != model_config.hf_config.hidden_size:
        raise ValueError(f"speculative_config model {head!r} has hidden_size {hf_config.hidden_size}, the target "
                         f"{model_config.hf_config.hidden_size}: an EAGLE head reads the target's hidden states, "
                         f"so it must be trained for this target.")
    hf_config.architectures = ["LlamaForCausalLM"]


def _check_multimodal_features(model_config: ModelConfig, lora_config: LoRAConfig | None,
                               speculative_config: Any) -> None:
    """A vision-language model runs without pipeline parallelism, LoRA or speculative
    decoding: the stages, the draft model and the LoRA layers are not wired to the image
    embeddings yet. (Under tensor parallelism every rank runs the whole vision tower and
    merges the same embeddings into its input rows.)"""
    architecture = (getattr(model_config.hf_config, "architectures", None) or ["?"])[0]
    # (Pipeline parallelism is refused before: LLaVA is not among the models that split.)
    refused = [(lora_config is not None, "enable_lora"),
               (speculative_config is not None, "speculative_config"),
               (model_config.is_pooling, "runner 'pooling'")]
    for is_set, name in refused:
        if is_set:
            raise ValueError(f"{name} is not supported for the vision-language model {architecture} yet: "
                             f"multi-modal models run without pipeline parallelism, LoRA or speculative "
                             f"decoding.")


def _check_prompt_embeds_features(model_config: ModelConfig, parallel_config: ParallelConfig,
                                  speculative_config: Any) -> None:
    """enable_prompt_embeds needs a model whose decoder takes given embeddings
    (`supports_prompt_embeds`: the Llama family), generating, on one pipeline stage, without
    speculative decoding: a draft model or n-gram proposer would see the prompt's placeholder
    ids, and the stages after the first are not wired to the embeddings."""
    architecture = (getattr(model_config.hf_config, "architectures", None) or ["?"])[0]
    refused = [(model_config.is_pooling, "runner 'pooling'"),
               (model_config.is_multimodal, f"the vision-language model {architecture}"),
               (speculative_config is not None, "speculative_config"),
               (parallel_config.pipeline_parallel_size > 1,
                f"pipeline_parallel_size {parallel_config.pipeline_parallel_size}")]
    for is_set, name in refused:
        if is_set:
            raise ValueError(f"enable_prompt_embeds is not supported with {name}: prompt embeddings run on "
                             f"generating Llama-family models, without speculative decoding or pipeline "
                             f"parallelism (docs/prompt_embeds.md).")
    model_class = resolve_model_class(getattr(model_config.hf_config, "architectures", None))
    if not getattr(model_class, "supports_prompt_embeds", False):
        raise ValueError(f"enable_prompt_embeds is not supported for {architecture}: its decoder takes token ids "
                         f"only (prompt embeddings run on Llama-family models: docs/prompt_embeds.md).")


def _check_whole_image_budget(model_config: ModelConfig, scheduler_config: SchedulerConfig) -> None:
    """Under disable_chunked_mm_input (Gemma 3) an image's tokens go into one step whole: the
    step's budget must hold one image."""
    tokens_per_image = image_feature_size(model_config.hf_config)
    if (scheduler_config.disable_chunked_mm_input and tokens_per_image is not None
            and scheduler_config.max_num_batched_tokens < tokens_per_image):
        raise ValueError(f"max_num_batched_tokens ({scheduler_config.max_num_batched_tokens}) must be at least the "
                         f"{tokens_per_image} tokens of one image for {model_config.hf_config.architectures[0]}, "
                         f"whose image tokens attend to each other both ways and so are computed in one step.")

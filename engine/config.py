"""Validated engine configuration, built once from `EngineArgs` and shared read-only.

These are plain dataclasses: the driver builds them and ships them to workers.
"""

from __future__ import annotations

import logging
import platform
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from raylm.engine.usage_context import UsageContext
from raylm.kernels.kv_cache_dtype import check_kv_cache_dtype, kv_cache_torch_dtype

logger = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}

# vLLM's load_format values raylm reads: "auto" and "safetensors" read the model folder's
# *.safetensors files (raylm reads no other checkpoint format), "dummy" reads none of them
# and gives every weight random values (models/weight_utils.initialize_dummy_weights), to
# benchmark a model's shape without its weights; config.json and the tokenizer are still
# read from the folder.
LOAD_FORMATS = ("auto", "safetensors", "dummy")
# vLLM V1's logprobs_mode: what a request's logprobs (and top alternatives) hold. "raw": the
# model's logits before any sampling stage; "processed": after them all (for random rows also
# temperature, min-p, top-k and top-p, the tokens they cut at -inf; greedy rows stop after
# the penalties, as vLLM's greedy path does); "logprobs": log-softmaxed, "logits": as they are.
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
# vLLM's other values, named in the error that refuses them.
_VLLM_ONLY_LOAD_FORMATS = ("pt", "npcache", "tensorizer", "sharded_state", "gguf", "bitsandbytes", "mistral",
                           "runai_streamer", "runai_streamer_sharded", "fastsafetensors")


def check_load_format(load_format: str) -> str:
    """`load_format`, if raylm reads it; else a ValueError naming the choices."""
    if load_format in LOAD_FORMATS:
        return load_format
    choices = ", ".join(repr(choice) for choice in LOAD_FORMATS)
    if load_format in _VLLM_ONLY_LOAD_FORMATS:
        raise ValueError(f"load_format {load_format!r} is one of vLLM's that raylm does not read; raylm reads "
                         f"safetensors checkpoints only. load_format must be one of {choices}.")
    raise ValueError(f"load_format must be one of {choices}; got {load_format!r}.")


# Config keys that bound the context length, in the order transformers models use them.
_MAX_LEN_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length")


def hf_config_dtype(hf_config: Any) -> torch.dtype | None:
    """The checkpoint dtype: transformers 5.x writes `dtype`, 4.x wrote `torch_dtype`."""
    for key in ("dtype", "torch_dtype"):
        value = getattr(hf_config, key, None)
        if isinstance(value, torch.dtype):
            return value
        if isinstance(value, str) and value in _DTYPES:
            return _DTYPES[value]
    return None


def cpu_has_fast_bf16() -> bool:
    """Whether this CPU multiplies bf16 matrices natively (x86: AVX512-BF16 or AMX; Arm:
    the BF16 extension). Without it PyTorch widens bf16 to fp32 inside every matmul, which
    on this project's AVX2 machines made a bf16 decode step 3.5x slower than fp32."""
    if platform.machine().lower() in ("aarch64", "arm64"):
        try:
            return " bf16" in Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    probes = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    return any(probe() for probe in probes if probe is not None)


def resolve_dtype(dtype: str | torch.dtype, hf_config: Any, device: str) -> torch.dtype:
    """vLLM's rule: "auto" takes the checkpoint's dtype, but fp32 checkpoints run in fp16
    on GPUs. CPUs run half-precision checkpoints in bf16 (fp16 matmuls are slow there), or
    in fp32 when the CPU has no native bf16 matmul (`cpu_has_fast_bf16`); an explicit
    dtype is always kept."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        config_dtype = hf_config_dtype(hf_config) or torch.float32
        if device == "cpu":
            if config_dtype == torch.float32:
                return torch.float32
            if not cpu_has_fast_bf16():
                logger.info("dtype='auto': this CPU has no native bf16 matmul, so the %s checkpoint runs in "
                            "float32 (pass dtype='bfloat16' to keep half the memory).", config_dtype)
                return torch.float32
            return torch.bfloat16
        return torch.float16 if config_dtype == torch.float32 else config_dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of 'auto', {', '.join(repr(d) for d in _DTYPES)}; got {dtype!r}.")
    return _DTYPES[dtype]


# vLLM's sequence pooling types: the last token's final hidden state, the mean over the
# prompt's, or the first token's.
POOLING_TYPES = ("LAST", "MEAN", "CLS")


@dataclass
class PoolerConfig:
    """How a pooling engine turns a prompt's final hidden states into its embedding (vLLM's
    PoolerConfig, `--pooler-config`): `pooling_type` LAST (the default for embeddings), MEAN
    or CLS; `normalize` L2-normalizes it (a request's PoolingParams.normalize overrides it).
    Only LAST pooling reads a single row, so only it is computed across chunked prefill and
    prefix-cache hits; MEAN and CLS turn both off (as vLLM does)."""

    pooling_type: str = "LAST"
    normalize: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.pooling_type, str) or self.pooling_type.upper() not in POOLING_TYPES:
            raise ValueError(f"pooler_config pooling_type must be one of {', '.join(POOLING_TYPES)}, got "
                             f"{self.pooling_type!r}.")
        self.pooling_type = self.pooling_type.upper()
        if not isinstance(self.normalize, bool):
            raise ValueError(f"pooler_config normalize must be true or false, got {self.normalize!r}.")

    @property
    def supports_chunked_prefill(self) -> bool:
        return self.pooling_type == "LAST"

    @classmethod
    def from_value(cls, value: "PoolerConfig | dict | str | None", defaults: dict[str, Any] | None = None,
                   defaults_source: str | None = None) -> "PoolerConfig":
        """From a PoolerConfig, a dict or a JSON object string (the flag); None: defaults.
        `defaults` (the model folder's sentence-transformers pooling, read from
        `defaults_source`) fill the keys a dict or string leaves out, as vLLM fills the
        unset fields of its PoolerConfig; a PoolerConfig is taken whole."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            import json

            try:
                value = json.loads(value)
            except json.JSONDecodeError as error:
                raise ValueError(f"pooler_config must be a JSON object, got {value!r}: {error}.") from None
        value = {} if value is None else value
        if not isinstance(value, dict):
            raise ValueError(f"pooler_config must be a dict (a JSON object), got {type(value).__name__}.")
        known = {"pooling_type", "normalize"}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"pooler_config: unknown key(s) {unknown}; known: {sorted(known)}.")
        merged = {**(defaults or {}), **value}
        try:
            return cls(**merged)
        except ValueError as error:
            if defaults_source is None or "pooling_type" in value or "pooling_type" not in merged:
                raise
            raise ValueError(f"{error} The pooling type comes from {defaults_source}; give pooler_config's "
                             f"pooling_type to pool otherwise.") from None


# sentence-transformers' Pooling modes that are vLLM's pooling types (the others, max,
# weighted mean and mean / sqrt(length), are not pooled by raylm).
_SENTENCE_TRANSFORMERS_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN",
                                "pooling_mode_cls_token": "CLS"}
_ST_POOLING_MODULE = "sentence_transformers.models.Pooling"
_ST_NORMALIZE_MODULE = "sentence_transformers.models.Normalize"


def sentence_transformers_pooling(model: str) -> tuple[dict[str, Any], str] | None:
    """The pooler defaults a sentence-transformers model folder sets (vLLM's
    get_pooling_config), and the file they come from; None where the folder has no
    `modules.json` or it lists no Pooling module. `pooling_type` is the Pooling module's
    config's one `pooling_mode_*` that is true (absent where none is; where several are,
    or one raylm does not pool, their names, which PoolerConfig refuses); `normalize` is
    whether a Normalize module follows."""
    import json

    modules_path = Path(model) / "modules.json"
    if not modules_path.is_file():
        return None
    try:
        modules = json.loads(modules_path.read_text())
        types = [module["type"] for module in modules]
        pooling = next((module for module in modules if module["type"] == _ST_POOLING_MODULE), None)
    except (json.JSONDecodeError, TypeError, KeyError) as error:
        raise ValueError(f"{modules_path} is not a sentence-transformers module list (a JSON list of objects with "
                         f"a 'type' and a 'path'): {error!r}.") from None
    if pooling is None:
        return None
    pooling_path = Path(model) / pooling.get("path", "") / "config.json"
    try:
        pooling_config = json.loads(pooling_path.read_text()) if pooling_path.is_file() else {}
    except json.JSONDecodeError as error:
        raise ValueError(f"{pooling_path} is not JSON: {error}.") from None
    defaults: dict[str, Any] = {"normalize": _ST_NORMALIZE_MODULE in types}
    modes = [key for key, value in pooling_config.items() if key.startswith("pooling_mode_") and value is True]
    if len(modes) == 1 and modes[0] in _SENTENCE_TRANSFORMERS_MODES:
        defaults["pooling_type"] = _SENTENCE_TRANSFORMERS_MODES[modes[0]]
    elif modes:
        defaults["pooling_type"] = " + ".join(modes)
    return defaults, str(pooling_path)


@dataclass
class ModelConfig:
    model: str
    tokenizer: str
    dtype: torch.dtype
    max_model_len: int
    hf_config: Any = field(repr=False)
    seed: int = 0
    trust_remote_code: bool = False
    revision: str | None = None
    tokenizer_mode: str = "auto"
    skip_tokenizer_init: bool = False
    # "triton" | "cpu" | "torch" | None (triton on CUDA, else cpu where it builds, else torch).
    attention_backend: str | None = None
    # "auto" (the model folder's generation_config.json), "vllm" (none) or a folder.
    generation_config: str = "auto"
    # vLLM's override_generation_config: generation_config.json keys merged over the file's.
    override_generation_config: dict[str, Any] | None = None
    # vLLM's max_logprobs: the most logprobs / prompt_logprobs a request may ask for
    # (-1: up to the vocabulary). Each one is a Logprob object per position and sequence.
    max_logprobs: int = 20
    # vLLM V1's logprobs_mode: what sampled tokens' logprobs hold (executors/sampler.py).
    logprobs_mode: str = "raw_logprobs"
    # vLLM's flag: no CUDA graphs, every step runs eagerly (executors/cuda_graphs.py).
    enforce_eager: bool = False
    # vLLM's runner: "generate" samples tokens; "pooling" returns one pooled vector per
    # prompt (embeddings), under `pooler_config`.
    runner_type: str = "generate"
    pooler_config: PoolerConfig | None = None
    # One of LOAD_FORMATS (vLLM keeps it in its LoadConfig; here the loader reads it with
    # the rest of the model's settings, and a draft model gets the target's).
    load_format: str = "auto"
    # vLLM's quantization: "fp8" or "compressed-tensors" (FP8 linear weights; compressed-tensors'
    # W4A16/W8A16 too), "gptq" or "awq" (packed integer ones; `models/quantization.py`); None
    # reads config.json's quantization_config, if any.
    quantization: str | None = None
    # vLLM's flag: LLM.sleep / wake_up may free the KV cache and the weights (docs/sleep_mode.md).
    enable_sleep_mode: bool = False
    # vLLM's limit_mm_per_prompt of a multi-modal model ({"image": n}; checked by EngineArgs).
    limit_mm_per_prompt: dict[str, int] | None = None
    # vLLM's flag: prompts may be given as embeddings [num_tokens, hidden_size] (engine/prompt_embeds.py).
    enable_prompt_embeds: bool = False
    # A causal LM read as a sequence classifier: its score head made of LM-head rows
    # (hf_overrides' classifier_from_token; models/seq_cls_conversion.py). None: the
    # checkpoint's own score head, if any.
    score_from_tokens: Any = None
    # vLLM's logits_processors, resolved (engine/logits_processor_classes.py): the custom
    # logits processors the sampling worker builds and runs (executors/logits_processors.py).
    logits_processors: tuple = ()

    @property
    def hf_text_config(self) -> Any:
        """The language model's config (vLLM's name): a multi-modal config's text_config, else hf_config."""
        get_text_config = getattr(self.hf_config, "get_text_config", None)
        return get_text_config() if get_text_config is not None else self.hf_config

    @property
    def is_multimodal(self) -> bool:
        """Whether the model takes images with its prompts (a vision-language model)."""
        from raylm.models.registry import is_multimodal_model
        return is_multimodal_model(getattr(self.hf_config, "architectures", None))

    @property
    def has_bidirectional_image_attention(self) -> bool:
        """Whether the tokens of one image attend to each other both ways (Gemma 3)."""
        from raylm.models.registry import has_bidirectional_image_attention
        return has_bidirectional_image_attention(getattr(self.hf_config, "architectures", None))

    @property
    def is_pooling(self) -> bool:
        return self.runner_type == "pooling"

    @property
    def pooling_task(self) -> str | None:
        """vLLM's pooling task of a pooling engine's model: "classify" for a sequence
        classifier (`*ForSequenceClassification`), else "embed"; None when generating."""
        if not self.is_pooling:
            return None
        from raylm.models.registry import pooling_task
        return pooling_task(getattr(self.hf_config, "architectures", None))

    @property
    def supported_pooling_tasks(self) -> tuple[str, ...]:
        """The pooling tasks requests may ask of this model (vLLM's): an embedding model
        "embed"s; a classifier "classify"s and "token_classify"s (its head at every token:
        LLM.reward), and with one label (a cross-encoder) "score"s."""
        task = self.pooling_task
        if task == "classify":
            return ("classify", "token_classify", "score") if getattr(self.hf_config, "num_labels", 0) == 1 \
                else ("classify", "token_classify")
        return () if task is None else ("embed",)

    @property
    def hidden_size(self) -> int:
        return self.hf_text_config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.hf_text_config.vocab_size

    @property
    def num_layers(self) -> int:
        return self.hf_text_config.num_hidden_layers

    @property
    def num_attention_heads(self) -> int:
        return self.hf_text_config.num_attention_heads

    @property
    def num_kv_heads(self) -> int:
        return getattr(self.hf_text_config, "num_key_value_heads", None) or self.num_attention_heads

    @property
    def layer_sliding_windows(self) -> list[int | None]:
        """Each layer's sliding window in tokens (None: the whole context), as Hugging Face
        applies them (`raylm.models.sliding_window`)."""
        from raylm.models.sliding_window import layer_sliding_windows
        return layer_sliding_windows(self.hf_text_config)

    @property
    def head_size(self) -> int:
        head_dim = getattr(self.hf_text_config, "head_dim", None)
        return head_dim or self.hf_text_config.hidden_size // self.num_attention_heads

    def num_kv_heads_per_rank(self, tensor_parallel_size: int) -> int:
        # KV heads are replicated, never split below one, when ranks outnumber them.
        return max(1, self.num_kv_heads // tensor_parallel_size)


def kv_cache_block_bytes(model_config: ModelConfig, block_size: int, tensor_parallel_size: int,
                         num_layers: int | None = None, cache_dtype: str = "auto") -> int:
    """Bytes of one KV-cache block on one worker: keys and values of every layer it holds
    (`num_layers`; default all of them, a pipeline stage holds its own), stored in
    `cache_dtype` (CacheConfig's: 1 byte an element for fp8)."""
    dtype_size = kv_cache_torch_dtype(cache_dtype, model_config.dtype).itemsize
    num_layers = model_config.num_layers if num_layers is None else num_layers
    return (2 * num_layers * block_size * model_config.num_kv_heads_per_rank(tensor_parallel_size)
            * model_config.head_size * dtype_size)


def load_hf_config(model: str, trust_remote_code: bool = False, revision: str | None = None) -> Any:
    from transformers import AutoConfig

    if not Path(model).is_dir():
        raise ValueError(f"model must be a local Hugging Face model folder (config.json, *.safetensors, "
                         f"tokenizer files) or 'raylm-demo-code' (the bundled demo model); {model!r} is not a "
                         f"folder. raylm does not download weights.")
    if not (Path(model) / "config.json").is_file():
        raise ValueError(f"model folder {model!r} has no config.json.")
    return AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code, revision=revision)


def derive_max_model_len(hf_config: Any, max_model_len: int | None) -> int:
    limit = next((getattr(hf_config, k) for k in _MAX_LEN_KEYS if getattr(hf_config, k, None)), None)
    if limit is None:
        limit = 2048
        logger.warning("config.json names no context length; assuming %d tokens.", limit)
    if max_model_len is None:
        return int(limit)
    if max_model_len < 1:
        raise ValueError(f"max_model_len must be at least 1, got {max_model_len}.")
    if max_model_len > limit:
        raise ValueError(f"max_model_len {max_model_len} exceeds the model's context length {limit} "
                         f"(from config.json).")
    return max_model_len


@dataclass
class CacheConfig:
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    # CPU only: bytes of memory for the KV cache (vLLM's VLLM_CPU_KVCACHE_SPACE, in GiB
    # there); None sizes it to what max_num_seqs requests of max_model_len tokens can fill.
    cpu_kv_cache_space_bytes: int | None = None
    num_gpu_blocks_override: int | None = None
    # Keep full blocks cached after their request ends, and reuse them for equal prefixes.
    enable_prefix_caching: bool = True
    # vLLM's field: set from the model when every layer attends within a sliding window (the
    # widest of them); the KV-cache manager then frees the blocks a request's window has
    # passed. None: some layer reads the whole context, and every block is kept.
    sliding_window: int | None = None
    # Set after the workers have measured memory.
    num_gpu_blocks: int | None = None
    # vLLM's field (`kv_cache_dtype` among the engine arguments): "auto" stores keys and
    # values in the model's dtype; "fp8" (e4m3), "fp8_e4m3" and "fp8_e5m2" in one byte each,
    # scaled by each layer's k_scale and v_scale (raylm/kernels/kv_cache_dtype.py).
    cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}.")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}.")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError(f"num_gpu_blocks_override must be at least 1, got {self.num_gpu_blocks_override}.")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be at least 1 or None, got {self.sliding_window}.")
        check_kv_cache_dtype(self.cache_dtype)


def max_blocks_per_request(max_model_len: int, block_size: int, sliding_window: int | None,
                           max_num_batched_tokens: int) -> int:
    """The most KV blocks one request holds at once: a whole max_model_len context, or with
    a sliding window on every layer, what a step reads and writes (`KVCacheManager` frees the
    blocks before the window of the step's first new token): a chunk of up to
    max_num_batched_tokens new tokens and the window - 1 before it, on whichever blocks that
    span straddles."""
    whole = -(-max_model_len // block_size)
    if sliding_window is None:
        return whole
    return min(whole, -(-(sliding_window - 1 + max_num_batched_tokens) // block_size) + 1)


# The token budget of a step when none is given: with chunked prefill a budget bounds the
# time of a step (and so every running request's inter-token latency) while staying large
# enough for efficient matmuls; vLLM's V1 server uses the same default on most GPUs.
DEFAULT_CHUNKED_MAX_NUM_BATCHED_TOKENS = 2048

# vLLM's budgets on a GPU by who built the engine: offline runs favour throughput (fewer,
# larger prefill chunks), servers the inter-token latency of running requests. GPUs of 70
# GiB or more get larger ones, except the A100, where vLLM measured a larger budget lower
# throughput (its PR #17885). Other contexts keep DEFAULT_CHUNKED_MAX_NUM_BATCHED_TOKENS.
_LARGE_GPU_BYTES = 70 * 2**30
_GPU_BUDGETS = {UsageContext.LLM_CLASS: 8192, UsageContext.OPENAI_API_SERVER: 2048}
_LARGE_GPU_BUDGETS = {UsageContext.LLM_CLASS: 16384, UsageContext.OPENAI_API_SERVER: 8192}


def default_max_num_batched_tokens(device: str, usage_context: UsageContext, enable_chunked_prefill: bool,
                                   max_model_len: int, gpu: tuple[int, str] | None = None) -> int:
    """The step's token budget when none is given. Without chunked prefill a whole prompt
    must fit in one step. On the CPU chunked prefill keeps 2048 for every context (its
    figures in docs/performance.md were measured there). `gpu`: (total memory in bytes,
    name) of the first visible GPU, None where this process sees none (a Ray driver on a
    GPU-less head node: the smaller GPU budgets, as vLLM falls back)."""
    if not enable_chunked_prefill:
        return max(max_model_len, DEFAULT_CHUNKED_MAX_NUM_BATCHED_TOKENS)
    if device != "cuda":
        return DEFAULT_CHUNKED_MAX_NUM_BATCHED_TOKENS
    large = gpu is not None and gpu[0] >= _LARGE_GPU_BYTES and "a100" not in gpu[1].lower()
    return (_LARGE_GPU_BUDGETS if large else _GPU_BUDGETS).get(usage_context, DEFAULT_CHUNKED_MAX_NUM_BATCHED_TOKENS)


def visible_gpu() -> tuple[int, str] | None:
    """(total memory in bytes, name) of the first GPU this process sees, or None."""
    if not torch.cuda.is_available():
        return None
    properties = torch.cuda.get_device_properties(0)
    return properties.total_memory, properties.name


# vLLM's scheduling policies (`--scheduling-policy`).
SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = DEFAULT_CHUNKED_MAX_NUM_BATCHED_TOKENS
    max_model_len: int = 2048
    # Split prompts longer than the step's remaining budget over several steps.
    enable_chunked_prefill: bool = True
    # vLLM's flag: with workers in other processes (Ray), the driver makes a step's text
    # (detokenizing, stop strings) while the workers run the next step; True turns that off.
    disable_async_output_proc: bool = False
    # vLLM's async scheduling: with workers in other processes (Ray), step k+1 is scheduled
    # and sent while the workers run step k; its decode tokens are placeholders that the
    # workers fill with what they sampled in step k.
    async_scheduling: bool = True
    # The pipeline's stages (ParallelConfig.pipeline_parallel_size). Above 1 a request whose
    # token is being sampled is not scheduled again until that token is back (the first
    # stage needs it and the last samples it), and with async scheduling the running
    # requests are split into micro-batches that keep every stage busy
    # (`pipeline_schedule.py`).
    pipeline_parallel_size: int = 1
    # vLLM's scheduling policy: "fcfs" admits waiting requests in arrival order and preempts
    # the latest admitted; "priority" orders both by (priority, arrival_time), lowest first
    # (engine/scheduler.py).
    policy: str = "fcfs"
    # vLLM's disable_chunked_mm_input: a prompt chunk never ends inside an image's placeholder
    # tokens (it stops before the image, or takes the rest of it whole). Set for the models
    # whose image tokens attend to each other both ways (Gemma 3), which need every key of an
    # image cached when its queries attend.
    disable_chunked_mm_input: bool = False

    def __post_init__(self) -> None:
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                             f"got {self.policy!r}.")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}.")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}.")
        # Without chunking a prompt is prefilled whole, so one step must fit the longest.
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller than max_model_len "
                f"({self.max_model_len}) with chunked prefill off: the longest prompt could never be "
                f"scheduled. Raise max_num_batched_tokens, lower max_model_len or enable chunked prefill.")


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    # vLLM's name: stages of tensor_parallel_size workers each, every stage holding a
    # contiguous share of the layers (executors/pipeline_stages.py).
    pipeline_parallel_size: int = 1
    # vLLM's flag: MoE layers place whole experts on the tensor-parallel ranks (each rank runs
    # its experts for every token; one all-reduce sums them) instead of sharding every expert.
    enable_expert_parallel: bool = False
    # vLLM's meanings: "uni" runs the one worker in process, "ray" runs the workers as Ray
    # actors (even one); None is "uni" for one worker, "ray" for more. There is no "mp".
    distributed_executor_backend: str | None = None
    # Ray only: send each step to the workers through a Ray compiled graph (shared-memory
    # channels, built once) instead of one actor call per worker and step. Its readers
    # poll, so each worker holds a core busy between steps.
    ray_compiled_graph: bool = True
    # Ray only. Let the workers' placement group span nodes (PACK) instead of keeping
    # them on one node (STRICT_PACK).
    ray_span_nodes: bool = False
    # Ray on CPU only: the CPU share each worker's bundle reserves (fractions let several
    # workers share a core).
    ray_cpus_per_worker: float = 0.5
    # Ray only: how long to wait for the placement group before failing with what the
    # cluster has.
    placement_group_timeout_s: float = 60.0
    # Ray only: the longest a worker call (loading the model, one step, a collective) may
    # take before the workers are declared hung.
    worker_timeout_s: float = 600.0
    # vLLM's worker_extension_cls: "module.Class" whose methods every worker gains, for
    # collective_rpc (an RLHF trainer's weight updates); "" for none.
    worker_extension_cls: str = ""

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}.")
        if self.pipeline_parallel_size < 1:
            raise ValueError(f"pipeline_parallel_size must be at least 1, got {self.pipeline_parallel_size}.")
        backend = self.distributed_executor_backend
        if backend == "mp":
            raise ValueError("distributed_executor_backend 'mp' (vLLM's multiprocessing executor) does not exist "
                             "in raylm: use 'uni' to run one worker in this process or 'ray' to run the workers "
                             "as Ray actors (on one machine too).")
        allowed = (None, "uni", "ray")
        if backend not in allowed:
            raise ValueError(f"distributed_executor_backend must be one of {allowed}, got {backend!r}.")
        if backend == "uni" and self.world_size > 1:
            raise ValueError(f"distributed_executor_backend 'uni' runs one worker in process, but "
                             f"tensor_parallel_size is {self.tensor_parallel_size} and pipeline_parallel_size "
                             f"{self.pipeline_parallel_size}: use 'ray' (or leave it unset) for more than one "
                             f"worker.")
        if not self.ray_cpus_per_worker > 0:
            raise ValueError(f"ray_cpus_per_worker must be positive, got {self.ray_cpus_per_worker}.")
        for name in ("placement_group_timeout_s", "worker_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {getattr(self, name)}.")

    @property
    def world_size(self) -> int:
        """Workers in all: pipeline_parallel_size stages of tensor_parallel_size each."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def use_ray(self) -> bool:
        if self.distributed_executor_backend == "ray":
            return True
        return self.distributed_executor_backend is None and self.world_size > 1


@dataclass
class DeviceConfig:
    device: str = "cpu"

    @staticmethod
    def detect(device: str = "auto") -> "DeviceConfig":
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}.")
        return DeviceConfig(device)


# The largest LoRA rank an engine can be set up for (vLLM's largest choice of max_lora_rank).
MAX_SUPPORTED_LORA_RANK = 512


@dataclass
class LoRAConfig:
    """Multi-LoRA serving (`enable_lora`): the workers hold `max_loras` adapters at once in
    slots of rank `max_lora_rank`, and up to `max_cpu_loras` loaded adapters in host memory."""

    max_loras: int = 1
    max_lora_rank: int = 16
    # None: max_loras (vLLM's default).
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.max_loras, bool) or not isinstance(self.max_loras, int) or self.max_loras < 1:
            raise ValueError(f"max_loras must be a positive integer, got {self.max_loras!r}.")
        if (isinstance(self.max_lora_rank, bool) or not isinstance(self.max_lora_rank, int)
                or not 1 <= self.max_lora_rank <= MAX_SUPPORTED_LORA_RANK):
            raise ValueError(f"max_lora_rank must be an integer in [1, {MAX_SUPPORTED_LORA_RANK}], "
                             f"got {self.max_lora_rank!r}.")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        if isinstance(self.max_cpu_loras, bool) or not isinstance(self.max_cpu_loras, int) \
                or self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras must be an integer of at least max_loras ({self.max_loras}): every "
                             f"adapter in a slot is also held in host memory; got {self.max_cpu_loras!r}.")


@dataclass
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig
    device_config: DeviceConfig
    # Speculative decoding (raylm.engine.spec_decode.SpeculativeConfig); None: off.
    speculative_config: Any = None
    # None: LoRA is off (enable_lora=False).
    lora_config: LoRAConfig | None = None

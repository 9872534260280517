"""The attention layer: stores the step's keys/values in this layer's paged KV cache and
attends over each sequence's cached context."""

from __future__ import annotations

import torch
from torch import nn

from raylm.kernels import torch_attention
from raylm.kernels.backend import SINKS_UNSUPPORTED, AttentionBackend, get_attention_backend
from raylm.kernels.image_attention import attend_image_spans
from raylm.models.forward_context import get_forward_context, select_rows


class Attention(nn.Module):
    """Takes q [T, Hq * D], k and v [T, Hkv * D] (this rank's heads) and returns
    [T, Hq * D], or only the rows `output_rows` (every key and value is still cached). The
    runner sets `kv_cache` to this layer's (k_cache, v_cache) pair, each
    [num_blocks, block_size, Hkv, D], after allocating the caches.

    `sliding_window` w (vLLM's per-layer window): each query attends to the last w
    positions, itself included, as Hugging Face's sliding-window layers do; None: the whole
    context. `logits_soft_cap` c (Gemma 2): scores s become c * tanh(s / c) before the
    softmax. Every backend implements both (see `raylm.kernels.torch_attention`).

    `k_scale`, `v_scale` (vLLM's per-layer names): an fp8 KV cache
    (`kv_cache_dtype`, `raylm.kernels.kv_cache_dtype`) stores k / k_scale and v / v_scale;
    1.0 unless the checkpoint carries this layer's (`load_kv_scale`).

    `has_sinks` (gpt-oss): the layer holds `sinks` [num_heads], one learned logit per query
    head (this rank's heads of the checkpoint's [total heads]) that joins each softmax's
    denominator with no value. Only backends with `supports_sinks` run such a layer; setting
    another as `attn_backend` is an error."""

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None,
                 sliding_window: int | None = None, logits_soft_cap: float | None = None,
                 has_sinks: bool = False) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.num_kv_heads = num_kv_heads or num_heads
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads}).")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be a positive number of tokens or None, got {sliding_window}.")
        if logits_soft_cap is not None and not logits_soft_cap > 0:
            raise ValueError(f"logits_soft_cap must be positive or None, got {logits_soft_cap}.")
        self.sliding_window = None if sliding_window is None else int(sliding_window)
        self.logits_soft_cap = None if logits_soft_cap is None else float(logits_soft_cap)
        self.kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None
        self.k_scale = 1.0
        self.v_scale = 1.0
        self.sinks: nn.Parameter | None = None
        if has_sinks:
            self.sinks = nn.Parameter(torch.empty(num_heads), requires_grad=False)
            self.sinks.weight_loader = self._load_sinks
        # The machine's default (kernels/backend.py); the runner sets the engine's choice
        # (`attention_backend`) after building the model.
        self.attn_backend = get_attention_backend()

    @property
    def attn_backend(self) -> AttentionBackend:
        return self._attn_backend

    @attn_backend.setter
    def attn_backend(self, backend: AttentionBackend) -> None:
        if self.sinks is not None and not backend.supports_sinks:
            raise ValueError(SINKS_UNSUPPORTED.format(backend=backend.name))
        self._attn_backend = backend

    def _load_sinks(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        """This rank's heads of the checkpoint's sinks [total num heads] (heads are split
        over the tensor-parallel ranks in order, as QKVParallelLinear splits the queries)."""
        from raylm.parallel import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
        from raylm.parallel.checkpoint_slice import read_weight

        total = self.num_heads * get_tensor_model_parallel_world_size()
        if tuple(loaded.shape) != (total,):
            raise ValueError(f"checkpoint attention sinks have shape {tuple(loaded.shape)}, the model expects "
                             f"({total},) (num_attention_heads).")
        start = get_tensor_model_parallel_rank() * self.num_heads
        param.data.copy_(read_weight(loaded.narrow(0, start, self.num_heads)))

    def load_kv_scale(self, name: str, loaded: torch.Tensor, tensor_name: str | None = None) -> None:
        """Takes a checkpoint's `k_scale` or `v_scale` of this layer (a scalar, or one value
        per tensor-parallel shard or per KV head as some fp8 checkpoints store it: their
        maximum, as vLLM takes a list outside its per-head attention backends). Every value
        must be a positive finite fp32 normal number: a subnormal scale's reciprocal
        overflows and 16-bit caches or flushing kernels read it as 0."""
        assert name in ("k_scale", "v_scale"), name
        what = f"checkpoint tensor {tensor_name!r}" if tensor_name else \
            f"The checkpoint's {name} of an attention layer"
        if loaded.numel() == 0 or (loaded.dim() > 1 and loaded.numel() > 1):
            raise ValueError(f"{what} ({name}) must be a scalar or a list (one value per tensor-parallel shard or KV "
                             f"head), got shape {list(loaded.shape)}.")
        smallest, largest = torch.finfo(torch.float32).tiny, torch.finfo(torch.float32).max
        values = loaded.double().reshape(-1).tolist()
        bad = next((value for value in values if not smallest <= value <= largest), None)  # NaN too
        if bad is not None:
            raise ValueError(f"{what} must hold positive finite numbers (fp32 normal, at least {smallest:.3g}), "
                             f"got {bad}.")
        setattr(self, name, max(values))

    def fused_kv_cache(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float, float] | None:
        """(k_cache, v_cache, slot_mapping, k_scale, v_scale) of this step where the rotary kernel may store its
        keys and values itself (the Triton backend's cache, a step with attention metadata),
        saving the KV write's launch: `forward(..., kv_cached=True)` then skips it. None
        elsewhere."""
        attn_metadata = get_forward_context().attn_metadata
        if attn_metadata is None or self.kv_cache is None or self.attn_backend.name != "triton":
            return None
        return (*self.kv_cache, attn_metadata.slot_mapping, self.k_scale, self.v_scale)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                output_rows: torch.Tensor | None = None, kv_cached: bool = False) -> torch.Tensor:
        """kv_cached: k and v are in the cache already (stored by the rotary kernel at
        `fused_kv_cache()`'s slots)."""
        num_tokens = q.shape[0]
        q = q.view(num_tokens, self.num_heads, self.head_size)
        k = k.view(num_tokens, self.num_kv_heads, self.head_size)
        v = v.view(num_tokens, self.num_kv_heads, self.head_size)
        attn_metadata = get_forward_context().attn_metadata
        if attn_metadata is None:
            out = torch_attention.causal_attention(q, k, v, self.scale, sliding_window=self.sliding_window,
                                                   logits_soft_cap=self.logits_soft_cap, sinks=self.sinks)
        else:
            assert self.kv_cache is not None, "attention metadata is set but this layer has no KV cache"
            k_cache, v_cache = self.kv_cache
            if not kv_cached:
                self.attn_backend.write_kv_cache(k, v, k_cache, v_cache, attn_metadata.slot_mapping,
                                                 k_scale=self.k_scale, v_scale=self.v_scale)
            out = self._paged_attention(q, attn_metadata)
            image_spans = get_forward_context().image_spans
            if image_spans:
                attend_image_spans(out, q, k_cache, v_cache, attn_metadata, image_spans, self.scale,
                                   sliding_window=self.sliding_window, logits_soft_cap=self.logits_soft_cap,
                                   k_scale=self.k_scale, v_scale=self.v_scale, sinks=self.sinks)
        # The kernels attend for every query row; the last layer's is 1 / num_layers of them.
        return select_rows(out.reshape(num_tokens, self.num_heads * self.head_size), output_rows)

    def forward_rows(self, q_rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """What forward(q, k, v, output_rows) returns, [R, Hq * D], from the queries of the
        output rows alone (q_rows [R, Hq * D], rows ForwardContext.output_rows): every row's k
        and v [T, Hkv * D] are cached, then each output row attends as a one-token query at
        its position (`AttentionMetadata.for_rows`). Needs the step's attention metadata."""
        context = get_forward_context()
        assert context.attn_metadata is not None and self.kv_cache is not None
        num_tokens, num_rows = k.shape[0], q_rows.shape[0]
        k = k.view(num_tokens, self.num_kv_heads, self.head_size)
        v = v.view(num_tokens, self.num_kv_heads, self.head_size)
        k_cache, v_cache = self.kv_cache
        self.attn_backend.write_kv_cache(k, v, k_cache, v_cache, context.attn_metadata.slot_mapping,
                                         k_scale=self.k_scale, v_scale=self.v_scale)
        q = q_rows.view(num_rows, self.num_heads, self.head_size)
        out = self._paged_attention(q, context.output_rows_metadata())
        return out.reshape(num_rows, self.num_heads * self.head_size)

    def _paged_attention(self, q: torch.Tensor, attn_metadata) -> torch.Tensor:
        k_cache, v_cache = self.kv_cache
        return self.attn_backend.paged_attention(q, k_cache, v_cache, attn_metadata, self.scale,
                                                 sliding_window=self.sliding_window,
                                                 logits_soft_cap=self.logits_soft_cap, k_scale=self.k_scale,
                                                 v_scale=self.v_scale, **self._sink_option())

    def _sink_option(self) -> dict[str, torch.Tensor]:
        # Backends without sinks never see the keyword (and refuse such layers up front).
        return {} if self.sinks is None else {"sinks": self.sinks}


# vLLM fp8 checkpoints' per-layer KV-cache scales, by name suffix: the attributes each sets
# (`kv_scale`, an older spelling, is one scale for both). q_scale and prob_scale are for
# attention computed in fp8, which raylm does not do: read past.
_KV_SCALE_SUFFIXES = {".k_scale": ("k_scale",), ".v_scale": ("v_scale",), ".kv_scale": ("k_scale", "v_scale"),
                      ".q_scale": (), ".prob_scale": ()}


def load_checkpoint_kv_scale(model: nn.Module, name: str, tensor) -> bool:
    """Whether checkpoint tensor `name` is an attention layer's KV-cache scale, which it
    then gives that layer (`Attention.load_kv_scale`). The spellings vLLM reads:
    `<layer>.self_attn.k_scale`, `<layer>.self_attn.k_proj.k_scale` (and v_proj.v_scale),
    `<layer>.self_attn.attn.k_scale`. A scale whose layer holds no attention layer is an
    error naming it."""
    from raylm.parallel.checkpoint_slice import read_weight

    suffix = next((s for s in _KV_SCALE_SUFFIXES if name.endswith(s)), None)
    if suffix is None:
        return False
    prefix = name[:-len(suffix)]
    for part in (".k_proj", ".v_proj", ".attn"):
        prefix = prefix.removesuffix(part)
    modules = dict(model.named_modules())
    layer = modules.get(prefix + ".attn", modules.get(prefix))
    if not isinstance(layer, Attention):
        raise ValueError(f"checkpoint tensor {name!r} is a KV-cache scale, but {prefix!r} is no attention layer of "
                         f"{type(model).__name__}.")
    for attribute in _KV_SCALE_SUFFIXES[suffix]:
        layer.load_kv_scale(attribute, read_weight(tensor), name)
    return True


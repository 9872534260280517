"""Which decoder layers attend within a sliding window, and how wide, read from a Hugging
Face config the way transformers builds its masks.

A window w means what Hugging Face's `sliding_window_overlay` means: the query at position
p attends to keys p - w + 1 .. p, w keys with itself (transformers 5.x masks key k when
k <= p - w).

- Mistral (v0.1): every layer, when `sliding_window` is set (transformers' MistralModel
  builds one sliding mask for all layers and ignores `layer_types`).
- Models with `layer_types` (Gemma 2 and 3, Qwen2, Qwen3, ...): the layers named
  "sliding_attention". transformers fills `layer_types` from the older keys when a config
  lacks it: Gemma 2 windows the even layers, Gemma 3 all but every
  `sliding_window_pattern`-th, Qwen2 / Qwen3 the layers from `max_window_layers` on, and
  only with `use_sliding_window` (otherwise it sets `sliding_window` to None).
- Configs without `layer_types` (older transformers): the same rules from those keys.

A window that covers `max_position_embeddings` can never exclude a key, so it is reported
as None: such layers are full attention for every context the model accepts.
"""

from __future__ import annotations

from typing import Any

SLIDING = "sliding_attention"


def layer_sliding_windows(config: Any) -> list[int | None]:
    """Each decoder layer's window in tokens, or None where the layer attends to its whole
    context."""
    num_layers = int(config.num_hidden_layers)
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return [None] * num_layers
    window = int(window)
    if window < 1:
        raise ValueError(f"sliding_window must be a positive number of tokens, got {window}.")
    max_positions = getattr(config, "max_position_embeddings", None)
    if max_positions is not None and window >= max_positions:
        return [None] * num_layers
    return [window if sliding else None for sliding in sliding_attention_layers(config)]


# transformers' sliding_window_pattern defaults, for configs that set neither it nor layer_types.
_DEFAULT_PATTERNS = {"gemma2": 2, "gemma3_text": 6}


def sliding_attention_layers(config: Any) -> list[bool]:
    """Whether each decoder layer is of the sliding kind (Hugging Face's "sliding_attention"),
    whatever its window's width, for a config whose model has such layers: Gemma 3 gives
    them their own rotary base even where the window covers the whole context."""
    num_layers = int(config.num_hidden_layers)
    model_type = getattr(config, "model_type", None)
    layer_types = getattr(config, "layer_types", None)
    if model_type == "mistral":
        return [True] * num_layers
    if layer_types is not None:
        if len(layer_types) != num_layers:
            raise ValueError(f"config.layer_types names {len(layer_types)} layers, but num_hidden_layers is "
                             f"{num_layers}.")
        return [kind == SLIDING for kind in layer_types]
    # Configs that predate layer_types: transformers' own defaults for them.
    if getattr(config, "max_window_layers", None) is not None:
        return [i >= config.max_window_layers for i in range(num_layers)]
    pattern = getattr(config, "sliding_window_pattern", None) or _DEFAULT_PATTERNS.get(model_type)
    if pattern is not None:
        return [(i + 1) % pattern != 0 for i in range(num_layers)]
    return [True] * num_layers


def kv_cache_sliding_window(windows: list[int | None]) -> int | None:
    """The window the KV-cache manager may free blocks behind: the widest of the layers'
    when every layer is windowed; None when any layer reads its whole context (all layers
    share one block table, so a block one full-attention layer still reads stays)."""
    if not windows or any(window is None for window in windows):
        return None
    return max(windows)

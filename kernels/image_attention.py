"""Bidirectional attention within an image (Gemma 3; Hugging Face's token_type_ids mask): the
queries of one image's tokens attend to every token of that image, later ones included, and
causally to what comes before it; text stays causal. A sliding-window layer still limits each
query to keys less than `sliding_window` positions back (HF: AND(window, OR(causal, image))).

Every backend's paged attention is causal; `attend_image_spans` then recomputes the rows of
each image's queries of the step over the paged cache with the image's mask, in PyTorch (an
image's rows are mm_tokens_per_image of a prefill step, once per image). The scheduler keeps an
image's uncomputed tokens in one step (`disable_chunked_mm_input`), so all of its keys are in
the cache when its queries attend.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from raylm.kernels.attention_metadata import AttentionMetadata, rows_sequences
from raylm.kernels.kv_cache_dtype import dequantize
from raylm.kernels.torch_attention import _gather, _math_attention


@dataclass(frozen=True)
class ImageSpan:
    """One image's queries in a step: packed rows row .. row + (end - query_start) - 1 hold
    positions query_start .. end - 1 of the image at positions start .. end - 1 (query_start
    is past start when a prefix-cache hit computed the image's first tokens)."""

    row: int
    query_start: int
    start: int
    end: int

    @property
    def num_rows(self) -> int:
        return self.end - self.query_start


def attend_image_spans(out: torch.Tensor, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       md: AttentionMetadata, spans: list[ImageSpan], scale: float, *,
                       sliding_window: int | None = None, logits_soft_cap: float | None = None,
                       k_scale: float = 1.0, v_scale: float = 1.0, sinks: torch.Tensor | None = None) -> None:
    """Overwrites the rows of `out` [T, Hq, D] that hold the spans' queries (query [T, Hq, D])
    with their attention under the image mask. Called after the step's keys and values are
    cached."""
    block_size = k_cache.shape[1]
    seqs, _ = rows_sequences(md.query_lens_list, md.seq_lens_list, [span.row for span in spans])
    for span, seq in zip(spans, seqs):
        first_key = 0 if sliding_window is None else max(0, span.query_start - sliding_window + 1)
        first_key -= first_key % block_size
        blocks = md.block_tables[seq, first_key // block_size:-(-span.end // block_size)].long()
        key = _gather(k_cache, blocks).flatten(0, 1)[:span.end - first_key]  # [L, Hkv, D]
        value = _gather(v_cache, blocks).flatten(0, 1)[:span.end - first_key]
        device = query.device
        query_positions = torch.arange(span.query_start, span.end, device=device)
        key_positions = torch.arange(first_key, span.end, device=device)
        distance = query_positions[:, None] - key_positions[None, :]
        mask = (distance >= 0) | (key_positions >= span.start)[None, :]
        if sliding_window is not None:
            mask &= distance < sliding_window
        rows = slice(span.row, span.row + span.num_rows)
        q = query[rows].transpose(0, 1).unsqueeze(0).float()
        k = dequantize(key.transpose(0, 1).unsqueeze(0), k_scale)
        v = dequantize(value.transpose(0, 1).unsqueeze(0), v_scale)
        attended = _math_attention(q, k, v, mask, scale, logits_soft_cap, sinks)
        out[rows] = attended[0].transpose(0, 1).to(out.dtype)

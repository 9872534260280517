"""The per-forward state that attention layers read without threading it through
`model(input_ids, positions)`: the runner sets it around each forward."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from raylm.kernels.attention_metadata import AttentionMetadata
from raylm.kernels.image_attention import ImageSpan


@dataclass
class ForwardContext:
    # None: a profiling/dummy run without KV caches; attention treats the packed tokens
    # as one causal sequence.
    attn_metadata: AttentionMetadata | None = None
    # Rows of the packed tokens whose final hidden states the step reads (the sampled
    # rows, then the prompt-logprob rows), in the order the model returns them; None: all.
    # Every layer but the last must run on every token, whose keys and values later
    # tokens attend to; the last layer's outputs feed only the logits. So models run the
    # last layer's attention output projection and MLP, and the final norm, on these rows
    # alone: in a prefill step of whole prompts that is one row per prompt, and skips
    # about 1 / num_layers of the step's GEMM work.
    output_rows: torch.Tensor | None = None
    # output_rows as a Python list, so that no layer reads the tensor back (on a GPU that
    # would wait for every kernel queued before it).
    output_rows_list: list[int] | None = None
    # The step's images whose tokens attend to each other both ways (Gemma 3's
    # `bidirectional_image_attention`; `kernels/image_attention.py`); None: all causal.
    image_spans: list[ImageSpan] | None = None
    # attn_metadata.for_rows(output_rows), when the runner built it with the step's inputs.
    _output_rows_metadata: AttentionMetadata | None = field(default=None, repr=False)

    def output_rows_metadata(self) -> AttentionMetadata:
        """attn_metadata.for_rows(output_rows): attention from the output rows alone, for a
        last layer that computes queries for those rows only. Built at the first call of the
        step (the last layer's) unless the runner passed it, kept for the rest of it."""
        assert self.attn_metadata is not None and self.output_rows is not None
        if self._output_rows_metadata is None:
            rows = self.output_rows_list if self.output_rows_list is not None else self.output_rows.tolist()
            self._output_rows_metadata = self.attn_metadata.for_rows(rows)
        return self._output_rows_metadata


_forward_context = ForwardContext()


def get_forward_context() -> ForwardContext:
    return _forward_context


@contextmanager
def set_forward_context(attn_metadata: AttentionMetadata | None, output_rows: torch.Tensor | None = None,
                        output_rows_list: list[int] | None = None,
                        output_rows_metadata: AttentionMetadata | None = None,
                        image_spans: list[ImageSpan] | None = None) -> Iterator[ForwardContext]:
    global _forward_context
    previous = _forward_context
    _forward_context = ForwardContext(attn_metadata, output_rows, output_rows_list, image_spans,
                                      output_rows_metadata)
    try:
        yield _forward_context
    finally:
        _forward_context = previous


def step_output_rows(rows: list[int], num_tokens: int) -> list[int] | None:
    """ForwardContext.output_rows for a step that reads `rows` of its num_tokens rows:
    None when it reads every row in order (decode). A step that reads none (a prompt
    chunk short of the prompt's end) keeps its last row, so that no kernel or
    collective of the last layer sees an empty batch."""
    if len(rows) == num_tokens and rows == list(range(num_tokens)):
        return None
    return rows or [num_tokens - 1]


def select_rows(x: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """x's rows `rows` (a layer's output rows), or x itself when rows is None."""
    return x if rows is None else x.index_select(0, rows)


def last_layer_rows(layer_index: int, num_layers: int) -> torch.Tensor | None:
    """The output rows (ForwardContext.output_rows) for layer `layer_index`: the last
    layer's, None (every row) for the others."""
    return get_forward_context().output_rows if layer_index == num_layers - 1 else None

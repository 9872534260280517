"""The per-forward state that attention layers read without threading it through
`model(input_ids, positions)`: the runner sets it around each forward."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from raylm.kernels.attention_metadata import AttentionMetadata


@dataclass
class ForwardContext:
    # None: a profiling/dummy run without KV caches; attention treats the packed tokens
    # as one causal sequence.
    attn_metadata: AttentionMetadata | None = None


_forward_context = ForwardContext()


def get_forward_context() -> ForwardContext:
    return _forward_context


@contextmanager
def set_forward_context(attn_metadata: AttentionMetadata | None) -> Iterator[ForwardContext]:
    global _forward_context
    previous = _forward_context
    _forward_context = ForwardContext(attn_metadata)
    try:
        yield _forward_context
    finally:
        _forward_context = previous

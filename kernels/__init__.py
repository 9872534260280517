"""Attention kernels: the PyTorch reference (CPU path) and the Triton kernels (imported only when chosen)."""

from raylm.kernels.attention_metadata import AttentionMetadata
from raylm.kernels.backend import AttentionBackend, get_attention_backend
from raylm.kernels.torch_attention import paged_attention, write_kv_cache

__all__ = ["AttentionBackend", "get_attention_backend", "AttentionMetadata", "paged_attention", "write_kv_cache"]

"""Attention kernels: the PyTorch reference (CPU path) and, later, Triton kernels."""

from raylm.kernels.attention_metadata import AttentionMetadata
from raylm.kernels.torch_attention import paged_attention, write_kv_cache

__all__ = ["AttentionMetadata", "paged_attention", "write_kv_cache"]

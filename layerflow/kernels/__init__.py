"""Triton kernels of the cached path (paged HSTU attention, KV append) and their torch references."""

from layerflow.kernels.attention import AttentionTiling, PagedAttention, default_tiling
from layerflow.kernels.kv_append import kv_append
from layerflow.kernels.reference import kv_append_reference, paged_attention_reference

__all__ = ["AttentionTiling", "PagedAttention", "default_tiling", "kv_append", "kv_append_reference",
           "paged_attention_reference"]

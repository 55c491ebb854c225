"""The torch attention backend: the CPU path (and a portable fallback on any device).

The math lives in `pagedcore.kernels.cpu_attention` beside the Triton kernels it mirrors: decode
rows batched into one block-granular gather + SDPA, prefill rows through SDPA per sequence.
"""

from __future__ import annotations

import torch

from pagedcore.attention.backend import AttentionBackend, AttentionMetadata
from pagedcore.kernels.cpu_attention import cpu_paged_attention


def write_kv_cache(key, value, k_cache, v_cache, slot_mapping) -> None:
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def forward(self, query, key, value, k_cache, v_cache, metadata: AttentionMetadata, scale,
                sliding_window=None, softcap=None) -> torch.Tensor:
        write_kv_cache(key, value, k_cache, v_cache, metadata.slot_mapping)
        return cpu_paged_attention(query, k_cache, v_cache, metadata, scale, sliding_window, softcap)

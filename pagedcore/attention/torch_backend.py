"""The torch attention backend: the CPU path (and a portable fallback on any device).

The math lives in `pagedcore.kernels.cpu_attention` beside the Triton kernels it mirrors: decode
rows batched into one block-granular gather + SDPA, prefill rows through SDPA per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedcore.attention.backend import AttentionBackend, AttentionMetadata
from pagedcore.kernels import cpu_ext
from pagedcore.kernels.cpu_attention import cpu_paged_attention


def write_kv_cache(key, value, k_cache, v_cache, slot_mapping) -> None:
    ext = cpu_ext.load() if key.device.type == "cpu" else None
    if ext is not None and k_cache.is_contiguous() and v_cache.is_contiguous():
        ext.write_kv_cache(key.to(k_cache.dtype), value.to(v_cache.dtype), k_cache, v_cache, slot_mapping)
        return
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


@dataclass
class TorchAttentionMetadata:
    common: AttentionMetadata
    decode_plans: dict = field(default_factory=dict)  # sliding window -> plans, filled by the first layer


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def build_metadata(self, common: AttentionMetadata) -> TorchAttentionMetadata:
        return TorchAttentionMetadata(common)

    def forward(self, query, key, value, k_cache, v_cache, metadata, scale,
                sliding_window=None, softcap=None) -> torch.Tensor:
        if isinstance(metadata, AttentionMetadata):  # called without build_metadata (tests, plugins)
            metadata = TorchAttentionMetadata(metadata)
        write_kv_cache(key, value, k_cache, v_cache, metadata.common.slot_mapping)
        return cpu_paged_attention(query, k_cache, v_cache, metadata.common, scale, sliding_window, softcap,
                                   plans=metadata.decode_plans)

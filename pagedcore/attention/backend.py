"""The attention-backend contract: what every backend (torch CPU, Triton GPU, plugins) implements.

The model runner describes each step as one flattened, unpadded batch (vLLM v1 names) in
`AttentionMetadata`; a backend may derive its own metadata from it once per step in
`build_metadata` and receives that object back in every layer's `forward`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    """One step's flattened batch: B sequences, T new tokens in all.

    Sequence i owns query tokens `query_start_loc[i]:query_start_loc[i+1]`; its context after this
    step is `seq_lens[i]` tokens, so its new tokens sit at positions
    `seq_lens[i] - query_len_i ... seq_lens[i] - 1`. Its K/V live in the blocks listed in
    `block_table[i]` (padded with 0 past the last block; never read beyond `seq_lens[i]`).
    """

    num_tokens: int
    query_start_loc: torch.Tensor  # int32 [B + 1], on the model's device
    seq_lens: torch.Tensor  # int32 [B]
    block_table: torch.Tensor  # int32 [B, max_blocks_per_seq]
    slot_mapping: torch.Tensor  # int64 [T]: block_id * block_size + offset of each new token
    max_query_len: int
    max_seq_len: int
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    block_size: int
    # each sequence's prompt length, where known: a backend may run a chunk of prompt tokens and one of generated
    # tokens (speculative verification) through different kernels (torch_backend.split_short_queries)
    num_prompt_tokens_cpu: list[int] | None = None


class AttentionBackend(ABC):
    """A paged-attention implementation.

    KV cache layout, per layer: `k_cache`, `v_cache` each `[num_blocks, block_size, num_kv_heads, head_dim]`,
    or, for a quantized `kv_cache_dtype`, uint8 `[num_blocks, block_bytes]` blocks holding int8/fp8 values
    and their scales (`pagedcore.kernels.kv_quant`: `layout_of`, `split`). Block copies and swaps move
    whole blocks either way.
    """

    name: str = "abstract"
    kv_cache_dtypes: tuple[str, ...] = ("auto",)  # EngineConfig.kv_cache_dtype values this backend reads

    def build_metadata(self, common: AttentionMetadata) -> Any:
        """Derive backend-specific metadata once per step (default: use the common one)."""
        return common

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,  # [T, num_q_heads, head_dim]
        key: torch.Tensor,  # [T, num_kv_heads, head_dim]
        value: torch.Tensor,  # [T, num_kv_heads, head_dim]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: Any,
        scale: float,
        sliding_window: int | None = None,  # key j visible to query i iff i - j < sliding_window
        softcap: float | None = None,  # scores = softcap * tanh(scores / softcap)
    ) -> torch.Tensor:  # [T, num_q_heads, head_dim]
        """Write this step's key/value at `slot_mapping`, then attend each query token causally
        to its own sequence's whole context (cached prefix + new tokens)."""

    def copy_blocks(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy whole blocks src[i] -> dst[i] in every layer (copy-on-write)."""
        for k_cache, v_cache in kv_caches:
            k_cache[dst] = k_cache[src]
            v_cache[dst] = v_cache[src]

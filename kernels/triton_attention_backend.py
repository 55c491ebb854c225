"""`TritonAttentionBackend`: the attention contract implemented with the Triton kernels.

Per layer `forward`:
  1. `reshape_and_cache` writes this step's K/V into the paged cache (padding slots skipped);
  2. sequences with one new token go to the split-K decode kernel;
  3. all other sequences (prompts, chunked prefill, prefix hits) go to the varlen prefill kernel,
     which reads their whole context -- cached and new -- through the block table.
Both kernels take a list of sequence indices and write only their own rows, so a mixed batch
needs no reordering and no scatter. A quantized cache (kv_quant: uint8 blocks of int8 / fp8 values and
their per-(token, head) scales) goes to the same kernels as its values and scales views.

`build_metadata` runs once per step (not per layer): it splits the batch into decode / prefill
index lists on the host (from the `*_cpu` fields: no device sync), uploads them once, and caches
the split-K plan and its workspace so every layer reuses them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from pagedcore.attention.backend import AttentionBackend, AttentionMetadata
from pagedcore.kernels import kv_quant
from pagedcore.kernels.block_copy import copy_blocks as triton_copy_blocks
from pagedcore.kernels.block_copy import swap_blocks as _swap_blocks
from pagedcore.kernels.cache_write import reshape_and_cache
from pagedcore.kernels.decode_attention import paged_decode_attention
from pagedcore.kernels.decode_plan import DecodePlan, plan_decode
from pagedcore.kernels.prefill_attention import paged_prefill_attention


def _new_output(query: torch.Tensor) -> torch.Tensor:
    """The output buffer (uninitialised: the kernels write every row; tests poison it with NaN)."""
    return torch.empty_like(query)


@dataclass
class TritonAttentionMetadata:
    """Per-step derived metadata shared by every layer."""

    common: AttentionMetadata
    num_decodes: int
    num_prefills: int
    decode_seq_idx: torch.Tensor  # int32 [num_decodes] on device: sequences with query length 1
    prefill_seq_idx: torch.Tensor  # int32 [num_prefills]: sequences with query length > 1
    max_decode_seq_len: int
    max_prefill_query_len: int
    num_real_tokens: int  # tokens owned by sequences; rows past it are padding
    target_programs: int | None = None
    _plans: dict = field(default_factory=dict)  # (num_kv_heads, window) -> DecodePlan
    workspace: dict = field(default_factory=dict)  # split-K partial buffers, reused across layers

    @property
    def is_pure_decode(self) -> bool:
        return self.num_prefills == 0

    def decode_plan(self, num_kv_heads: int, sliding_window: int | None) -> DecodePlan:
        """Split-K plan for this step's decode launch; layers differ only by window (e.g. Gemma)."""
        key = (num_kv_heads, sliding_window)
        plan = self._plans.get(key)
        if plan is None:
            ctx = self.max_decode_seq_len
            if sliding_window is not None and sliding_window > 0:
                ctx = min(ctx, sliding_window)
            plan = plan_decode(self.num_decodes, num_kv_heads, ctx, target_programs=self.target_programs)
            self._plans[key] = plan
        return plan


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    kv_cache_dtypes = kv_quant.KV_CACHE_DTYPES  # fp8_e4m3 on GPUs of compute capability >= 8.9 (kv_quant)

    def __init__(self, target_programs: int | None = None) -> None:
        # Programs the decode kernel should launch to fill the device (None: 4 x SM count on GPU).
        self.target_programs = target_programs

    def build_metadata(self, common: AttentionMetadata) -> TritonAttentionMetadata:
        qsl = common.query_start_loc_cpu
        decode, prefill = [], []
        max_dec_len = 0
        max_pre_q = 0
        for i, seq_len in enumerate(common.seq_lens_cpu):
            q_len = qsl[i + 1] - qsl[i]
            if q_len == 1:
                decode.append(i)
                max_dec_len = max(max_dec_len, seq_len)
            elif q_len > 1:
                prefill.append(i)
                max_pre_q = max(max_pre_q, q_len)
        device = common.seq_lens.device
        num_seqs = len(common.seq_lens_cpu)
        if len(decode) == num_seqs:
            decode_idx = torch.arange(num_seqs, dtype=torch.int32, device=device)
        else:
            decode_idx = torch.tensor(decode, dtype=torch.int32, device=device)
        prefill_idx = torch.tensor(prefill, dtype=torch.int32, device=device)
        return TritonAttentionMetadata(
            common=common,
            num_decodes=len(decode),
            num_prefills=len(prefill),
            decode_seq_idx=decode_idx,
            prefill_seq_idx=prefill_idx,
            max_decode_seq_len=max_dec_len,
            max_prefill_query_len=max_pre_q,
            num_real_tokens=qsl[-1] if qsl else 0,
            target_programs=self.target_programs,
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: Any,
        scale: float,
        sliding_window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        if isinstance(metadata, AttentionMetadata):
            metadata = self.build_metadata(metadata)
        md: TritonAttentionMetadata = metadata
        common = md.common
        scales = {}
        if kv_quant.layout_of(k_cache) is not None:
            (k_cache, k_scales), (v_cache, v_scales) = kv_quant.split(k_cache), kv_quant.split(v_cache)
            scales = dict(k_scales=k_scales, v_scales=v_scales)
        else:
            assert query.dtype == k_cache.dtype, "the kernels expect the cache in the model dtype"
        num_tokens = query.shape[0]

        if key is not None and value is not None:
            reshape_and_cache(key, value, k_cache, v_cache, common.slot_mapping[:num_tokens], **scales)

        out = _new_output(query)
        if md.num_real_tokens < num_tokens:
            out[md.num_real_tokens :] = 0  # padding rows: defined, not garbage
        if md.num_decodes:
            paged_decode_attention(
                query,
                k_cache,
                v_cache,
                common.block_table,
                common.seq_lens,
                scale,
                sliding_window,
                softcap,
                query_start_loc=common.query_start_loc,
                seq_indices=md.decode_seq_idx,
                max_seq_len=md.max_decode_seq_len,
                out=out,
                plan=md.decode_plan(k_cache.shape[2], sliding_window),
                workspace=md.workspace,
                **scales,
            )
        if md.num_prefills:
            paged_prefill_attention(
                query,
                k_cache,
                v_cache,
                common.block_table,
                common.seq_lens,
                common.query_start_loc,
                md.max_prefill_query_len,
                scale,
                sliding_window,
                softcap,
                seq_indices=md.prefill_seq_idx,
                out=out,
                **scales,
            )
        return out

    def copy_blocks(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], src: torch.Tensor, dst: torch.Tensor) -> None:
        triton_copy_blocks(kv_caches, src, dst)

    @staticmethod
    def swap_blocks(src_cache: torch.Tensor, dst_cache: torch.Tensor, block_mapping: torch.Tensor) -> None:
        _swap_blocks(src_cache, dst_cache, block_mapping)

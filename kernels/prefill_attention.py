"""Varlen paged prefill attention: one kernel for any mix of query lengths.

Handles prompt prefill, chunked prefill and prefix-cache hits alike: sequence b's `qlen` new
tokens sit at positions `seq_len - qlen .. seq_len - 1` and attend causally to the *whole* context
-- cached prefix and the new tokens -- which is read entirely through the block table *after* the
cache write. There is therefore no separate "new K/V" path, and a prefix hit costs nothing extra.

Grid: (sequence, query block, kv_head). A program owns BLOCK_Q query tokens x the GROUP query heads
that share one KV head, packed as BLOCK_M = BLOCK_Q * GROUP rows (vLLM's unified-attention
layout): every K/V tile loaded is reused by all GQA heads. It walks the keys the block can see,
[window start of its first token, position of its last token], in tiles of BLOCK_N tokens
gathered through the block table, with an online softmax in fp32 (flash-attention 2).

A quantized cache (KV_QUANT) is read as in decode_attention.py: values widened to the query's dtype,
per-(token, head) scales applied to the score and weight tiles.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedcore.kernels.triton_utils import (
    LOG2E,
    NEG_BIG,
    apply_softcap,
    check_scales,
    dot_precision,
    mma,
    needs_dot_upcast,
)



def prefill_config(dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_M rows, BLOCK_N keys, num_warps). Chosen so that head_dim <= 128 compiles without
    register spills on sm_90 (checked with ptxas): fp32 dots run on FMA units and hold twice the
    bytes per element, so fp32 uses half-height tiles."""
    if dtype == torch.float32:
        return 32, 32, 8
    return 64, 32, 8


@triton.jit
def _prefill_kernel(
    out_ptr,  # [T, Hq, D]
    q_ptr,  # [T, Hq, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,
    k_scale_ptr,  # fp16 [num_blocks, block_size, Hkv] (used when KV_QUANT)
    v_scale_ptr,
    block_table_ptr,  # int32 [B, max_blocks]
    seq_lens_ptr,  # int32 [B]
    query_start_loc_ptr,  # int32 [B + 1]
    seq_idx_ptr,  # int32 [num_seqs]: the sequences this launch handles
    scale,
    softcap,
    sliding_window,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_sb,  # scale strides: block, slot-in-block (the head's is 1)
    stride_ss,
    stride_bt,
    head_dim,
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_Q: tl.constexpr,  # query tokens per program (BLOCK_M // GROUP)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # cache block size
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    DOT_PREC: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    KV_QUANT: tl.constexpr,  # int8 / fp8 cache with per-(token, head) scales
):
    pid_s = tl.program_id(0)
    q_block = tl.program_id(1)
    kv_head = tl.program_id(2)

    seq = tl.load(seq_idx_ptr + pid_s)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    first_tok = q_block * BLOCK_Q
    if first_tok >= q_len:
        return  # the grid is sized for the longest query in the launch
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len  # cached tokens before this step's first new token

    # Row r = (query token r // GROUP, head r % GROUP of this KV head's group).
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    row_tok = first_tok + offs_m // GROUP
    row_head = kv_head * GROUP + offs_m % GROUP
    row_mask = (offs_m < BLOCK_Q * GROUP) & (row_tok < q_len)
    d_mask = offs_d < head_dim
    q_pos = context_len + row_tok  # absolute position of each row's token

    q_rows = (q_start + row_tok).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + row_head[:, None] * stride_qh + offs_d[None, :],
        mask=row_mask[:, None] & d_mask[None, :],
        other=0.0,
    )

    m_i = tl.full([BLOCK_M], NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # Keys this block can see: up to its last token (causal) and, with a window, from the window
    # start of its first token. Everything outside is never loaded.
    last_pos = context_len + tl.minimum(first_tok + BLOCK_Q, q_len) - 1
    kv_end = last_pos + 1
    kv_begin = 0
    if USE_WINDOW:
        kv_begin = tl.maximum(context_len + first_tok - sliding_window + 1, 0)
        kv_begin = (kv_begin // BLOCK_N) * BLOCK_N  # aligned tiles

    bt_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    for start in range(kv_begin, kv_end, BLOCK_N):
        tok = start + offs_n
        tok_mask = tok < kv_end
        phys = tl.load(bt_row + tok // BLOCK_SIZE, mask=tok_mask, other=0).to(tl.int64)
        kv_off = phys * stride_cb + (tok % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
        kv_mask = tok_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + kv_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if KV_QUANT:
            s_off = phys * stride_sb + (tok % BLOCK_SIZE) * stride_ss + kv_head
            k_scale = tl.load(k_scale_ptr + s_off, mask=tok_mask, other=0.0).to(tl.float32)
            v_scale = tl.load(v_scale_ptr + s_off, mask=tok_mask, other=0.0).to(tl.float32)
            # Through fp32: exact, and Triton's interpreter turns int8 -> bf16 into bit patterns.
            k = k.to(tl.float32).to(q.dtype)
            v = v.to(tl.float32).to(q.dtype)

        s = mma(q, tl.trans(k), DOT_PREC, UPCAST_DOT)  # fp32 [BLOCK_M, BLOCK_N]
        if KV_QUANT:
            s = s * k_scale[None, :]
        if USE_SOFTCAP:
            s = apply_softcap(s * scale, softcap) * LOG2E
        else:
            s = s * (scale * LOG2E)
        visible = tok_mask[None, :] & (tok[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            visible = visible & ((q_pos[:, None] - tok[None, :]) < sliding_window)
        s = tl.where(visible, s, float("-inf"))

        # A row may see nothing in this tile (causal / window edge): m stays finite (NEG_BIG
        # init) and p = exp2(-inf) = 0, so the tile is a no-op for it.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if KV_QUANT:
            p = p * v_scale[None, :]
        acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, DOT_PREC, UPCAST_DOT)
        m_i = m_new

    # Real rows always see at least their own key (l > 0); padding rows are masked on store.
    l_i = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_i[:, None]
    tl.store(
        out_ptr + q_rows[:, None] * stride_ot + row_head[:, None] * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & d_mask[None, :],
    )


def prefill_block_shape(group: int, block_m: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_Q): rows per program and query tokens per program for a GQA group size."""
    block_m = max(block_m, triton.next_power_of_2(group))
    return block_m, block_m // group


def paged_prefill_attention(
    query: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # int32 [B, max_blocks]
    seq_lens: torch.Tensor,  # int32 [B]
    query_start_loc: torch.Tensor,  # int32 [B + 1]
    max_query_len: int,  # host-side max query length over the processed sequences
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    *,
    seq_indices: torch.Tensor | None = None,  # int32: sequences to process (default: all B)
    out: torch.Tensor | None = None,
    block_m: int | None = None,  # tile overrides (default: prefill_config(dtype))
    block_n: int | None = None,
    k_scales: torch.Tensor | None = None,  # fp16 [num_blocks, block_size, Hkv]: k/v_cache are int8 / fp8 values
    v_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of every new token to its sequence's whole paged context.

    Rows of `out` belonging to sequences not in `seq_indices` (and padding rows) are not written.
    """
    num_tokens, num_q_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert num_q_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads"
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1 and query.stride(2) == 1
    group = num_q_heads // num_kv_heads
    quant = check_scales(k_cache, v_cache, k_scales, v_scales)
    if out is None:
        out = torch.empty_like(query)
    if seq_indices is None:
        seq_indices = torch.arange(seq_lens.shape[0], dtype=torch.int32, device=query.device)
    num_seqs = seq_indices.shape[0]
    if num_seqs == 0 or max_query_len == 0:
        return out
    use_window = sliding_window is not None and sliding_window > 0
    use_softcap = softcap is not None and softcap > 0
    cfg_m, cfg_n, num_warps = prefill_config(query.dtype)
    block_m, block_q = prefill_block_shape(group, block_m or cfg_m)
    block_n = block_n or cfg_n

    grid = (num_seqs, triton.cdiv(max_query_len, block_q), num_kv_heads)
    _prefill_kernel[grid](
        out,
        query,
        k_cache,
        v_cache,
        k_scales if quant else k_cache,
        v_scales if quant else v_cache,
        block_table,
        seq_lens,
        query_start_loc,
        seq_indices,
        float(scale),
        float(softcap) if use_softcap else 1.0,
        int(sliding_window) if use_window else 0,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        k_scales.stride(0) if quant else 0,
        k_scales.stride(1) if quant else 0,
        block_table.stride(0),
        head_dim,
        GROUP=group,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size,
        USE_WINDOW=use_window,
        USE_SOFTCAP=use_softcap,
        DOT_PREC=dot_precision(query.dtype),
        UPCAST_DOT=needs_dot_upcast(query.dtype),
        KV_QUANT=quant,
        num_warps=num_warps,
    )
    return out

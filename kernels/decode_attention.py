"""Paged decode attention: one query token per sequence, split-K over long contexts.

Grid: (sequence, kv_head, partition). One program

  * loads the query rows of *all* query heads that share its KV head (GQA/MQA: each K/V tile is
    read from memory once and reused by `group = Hq // Hkv` heads -- decode is memory bound, so
    this divides K/V traffic by `group`);
  * walks its partition of the context in tiles of BLOCK_N tokens, finding each token's physical
    slot through the block table (so BLOCK_N is independent of the cache block size);
  * keeps an online softmax (running max `m`, running sum `l`, unnormalised accumulator `acc`).

Split-K (flash-decoding / vLLM paged-attention v2): with few sequences, (B x Hkv) programs cannot
fill a GPU, so each sequence's context is cut into `num_splits` partitions processed in parallel.
Each partition stores its partial (m, l, acc); a second small kernel rescales them to a common max
and sums. With one split the first kernel normalises and writes the output directly.

head_dim need not be a power of two (64/80/96/128...): tiles are padded to the next power of two
and masked.

Quantized cache (KV_QUANT, kernels/kv_quant.py): K/V tiles are int8 or e4m3 values, widened to the
query's dtype (exact: both fit bf16/fp16), with one fp16 scale per (token, KV head). The scales act on
the [heads, tokens] score and weight tiles, not on the [tokens, head_dim] K/V tiles: s = (q . k) * k_scale,
acc += (p * v_scale) . v, with the softmax sum taken over p itself.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedcore.kernels.decode_plan import DECODE_BLOCK_N, DecodePlan, plan_decode
from pagedcore.kernels.triton_utils import (
    LOG2E,
    NEG_BIG,
    apply_softcap,
    check_scales,
    dot_precision,
    mma,
    needs_dot_upcast,
)

DECODE_NUM_WARPS = 4


@triton.jit
def _decode_partition_kernel(
    out_ptr,  # [T, Hq, D] (used when DIRECT)
    part_acc_ptr,  # fp32 [num_seqs, Hq, max_splits, D] (used when not DIRECT)
    part_m_ptr,  # fp32 [num_seqs, Hq, max_splits]
    part_l_ptr,  # fp32 [num_seqs, Hq, max_splits]
    q_ptr,  # [T, Hq, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,
    k_scale_ptr,  # fp16 [num_blocks, block_size, Hkv] (used when KV_QUANT)
    v_scale_ptr,
    block_table_ptr,  # int32 [B, max_blocks]
    seq_lens_ptr,  # int32 [B]
    query_start_loc_ptr,  # int32 [B + 1]: the query row of sequence b
    seq_idx_ptr,  # int32 [num_seqs]: which sequences this launch handles
    scale,
    softcap,
    sliding_window,
    partition_size,  # tokens per partition (runtime: changing it does not recompile)
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
    stride_pa_s,  # partial-acc strides; part_m / part_l are [num_seqs, Hq, max_splits] contiguous
    stride_pa_h,
    stride_pa_p,
    num_q_heads,
    max_splits,
    head_dim,
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_SIZE: tl.constexpr,  # cache block size
    BLOCK_H: tl.constexpr,  # GROUP padded (>= 16 so tl.dot has a legal M on GPUs)
    BLOCK_D: tl.constexpr,  # head_dim padded to a power of two
    BLOCK_N: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    DIRECT: tl.constexpr,  # one split: normalise and write `out` here, no reduction kernel
    DOT_PREC: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    KV_QUANT: tl.constexpr,  # int8 / fp8 cache with per-(token, head) scales
):
    pid_s = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq = tl.load(seq_idx_ptr + pid_s)
    seq_len = tl.load(seq_lens_ptr + seq)
    q_row = tl.load(query_start_loc_ptr + seq).to(tl.int64)

    # The one query sits at position seq_len - 1; with a sliding window it sees only the last
    # `sliding_window` keys, so partitions are laid over [kv_start, seq_len) -- no work (and no
    # split) is spent on keys that are out of the window.
    kv_start = 0
    if USE_WINDOW:
        kv_start = tl.maximum(seq_len - sliding_window, 0)
    part_start = kv_start + split * partition_size
    if part_start >= seq_len:
        return  # this sequence is shorter than the longest one: nothing here (reducer skips it)
    part_end = tl.minimum(part_start + partition_size, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    head_mask = offs_h < GROUP
    d_mask = offs_d < head_dim
    heads = kv_head * GROUP + offs_h

    q = tl.load(
        q_ptr + q_row * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=head_mask[:, None] & d_mask[None, :],
        other=0.0,
    )

    m_i = tl.full([BLOCK_H], NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)

    bt_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    for start in range(part_start, part_end, BLOCK_N):
        tok = start + offs_n
        tok_mask = tok < part_end
        # Paged gather: token -> (physical block, offset in block).
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

        s = mma(q, tl.trans(k), DOT_PREC, UPCAST_DOT)  # fp32 [BLOCK_H, BLOCK_N]
        if KV_QUANT:
            s = s * k_scale[None, :]
        if USE_SOFTCAP:
            s = apply_softcap(s * scale, softcap) * LOG2E
        else:
            s = s * (scale * LOG2E)
        # Every key in [kv_start, seq_len) is visible to the last position: only the tail
        # of the tile needs masking.
        s = tl.where(tok_mask[None, :], s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if KV_QUANT:
            p = p * v_scale[None, :]
        # P is cast to V's dtype for the tensor-core dot (flash-attention does the same).
        acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, DOT_PREC, UPCAST_DOT)
        m_i = m_new

    if DIRECT:
        out = acc / l_i[:, None]
        tl.store(
            out_ptr + q_row * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=head_mask[:, None] & d_mask[None, :],
        )
    else:
        # Partial results stay unnormalised (acc, l) with their max m; the reducer rescales.
        ps = pid_s.to(tl.int64)
        acc_ptrs = part_acc_ptr + ps * stride_pa_s + heads[:, None] * stride_pa_h + split * stride_pa_p + offs_d[None, :]
        tl.store(acc_ptrs, acc, mask=head_mask[:, None] & d_mask[None, :])
        ml_off = (ps * num_q_heads + heads) * max_splits + split
        tl.store(part_m_ptr + ml_off, m_i, mask=head_mask)
        tl.store(part_l_ptr + ml_off, l_i, mask=head_mask)


@triton.jit
def _decode_reduce_kernel(
    out_ptr,
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    seq_idx_ptr,
    sliding_window,
    partition_size,
    stride_ot,
    stride_oh,
    stride_pa_s,
    stride_pa_h,
    stride_pa_p,
    num_q_heads,
    max_splits,
    head_dim,
    USE_WINDOW: tl.constexpr,
    BLOCK_SPLITS: tl.constexpr,  # max_splits padded to a power of two
    BLOCK_D: tl.constexpr,
):
    """out = sum_p exp(m_p - M) acc_p / sum_p exp(m_p - M) l_p over this sequence's partitions."""
    pid_s = tl.program_id(0)
    head = tl.program_id(1)

    seq = tl.load(seq_idx_ptr + pid_s)
    seq_len = tl.load(seq_lens_ptr + seq)
    q_row = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    kv_start = 0
    if USE_WINDOW:
        kv_start = tl.maximum(seq_len - sliding_window, 0)
    # Only the partitions the first kernel actually wrote (short sequences have fewer).
    num_parts = tl.cdiv(seq_len - kv_start, partition_size)

    offs_p = tl.arange(0, BLOCK_SPLITS)
    offs_d = tl.arange(0, BLOCK_D)
    p_mask = offs_p < num_parts
    d_mask = offs_d < head_dim

    ps = pid_s.to(tl.int64)
    ml_off = (ps * num_q_heads + head) * max_splits + offs_p
    m = tl.load(part_m_ptr + ml_off, mask=p_mask, other=float("-inf"))
    l = tl.load(part_l_ptr + ml_off, mask=p_mask, other=0.0)
    m_max = tl.max(m, axis=0)
    w = tl.where(p_mask, tl.exp2(m - m_max), 0.0)  # m is in the log2 domain (scores * log2e)
    l_tot = tl.sum(w * l, axis=0)

    acc = tl.load(
        part_acc_ptr + ps * stride_pa_s + head * stride_pa_h + offs_p[:, None] * stride_pa_p + offs_d[None, :],
        mask=p_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    out = tl.sum(acc * w[:, None], axis=0) / l_tot
    tl.store(out_ptr + q_row * stride_ot + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_mask)


def paged_decode_attention(
    query: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # int32 [B, max_blocks]
    seq_lens: torch.Tensor,  # int32 [B]
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    *,
    query_start_loc: torch.Tensor | None = None,  # int32 [B + 1]; default: row b is sequence b
    seq_indices: torch.Tensor | None = None,  # int32: sequences to process (default: all B)
    max_seq_len: int | None = None,  # host-side max over processed sequences (avoids a sync)
    out: torch.Tensor | None = None,
    plan: DecodePlan | None = None,
    num_splits: int | None = None,
    workspace: dict | None = None,  # reused split-K buffers (e.g. one per step, shared by layers)
    k_scales: torch.Tensor | None = None,  # fp16 [num_blocks, block_size, Hkv]: k/v_cache are int8 / fp8 values
    v_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over its paged context. Returns `out` [T, Hq, D].

    Rows of `out` that belong to sequences not in `seq_indices` are left untouched, so a mixed
    batch can run this on its decode sequences and the prefill kernel on the rest.
    """
    num_tokens, num_q_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert num_q_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads"
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1 and query.stride(2) == 1
    group = num_q_heads // num_kv_heads
    device = query.device
    quant = check_scales(k_cache, v_cache, k_scales, v_scales)
    if out is None:
        out = torch.empty_like(query)
    if query_start_loc is None:
        assert num_tokens == seq_lens.shape[0]
        query_start_loc = torch.arange(num_tokens + 1, dtype=torch.int32, device=device)
    if seq_indices is None:
        seq_indices = torch.arange(seq_lens.shape[0], dtype=torch.int32, device=device)
    num_seqs = seq_indices.shape[0]
    if num_seqs == 0:
        return out
    if max_seq_len is None:
        max_seq_len = int(seq_lens[seq_indices.long()].max().item())
    use_window = sliding_window is not None and sliding_window > 0
    use_softcap = softcap is not None and softcap > 0
    max_context = min(max_seq_len, sliding_window) if use_window else max_seq_len
    if plan is None:
        plan = plan_decode(num_seqs, num_kv_heads, max_context, num_splits=num_splits)

    direct = plan.num_splits == 1
    shape_acc = (num_seqs, num_q_heads, plan.num_splits, head_dim)
    if direct:
        part_acc = part_m = part_l = out  # unused placeholders
    else:
        key = (shape_acc, device)
        bufs = workspace.get(key) if workspace is not None else None
        if bufs is None:
            bufs = (
                torch.empty(shape_acc, dtype=torch.float32, device=device),
                torch.empty(shape_acc[:3], dtype=torch.float32, device=device),
                torch.empty(shape_acc[:3], dtype=torch.float32, device=device),
            )
            if workspace is not None:
                workspace[key] = bufs
        part_acc, part_m, part_l = bufs

    block_d = triton.next_power_of_2(head_dim)
    _decode_partition_kernel[(num_seqs, num_kv_heads, plan.num_splits)](
        out,
        part_acc,
        part_m,
        part_l,
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
        plan.partition_size,
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
        part_acc.stride(0) if not direct else 0,
        part_acc.stride(1) if not direct else 0,
        part_acc.stride(2) if not direct else 0,
        num_q_heads,
        plan.num_splits,
        head_dim,
        GROUP=group,
        BLOCK_SIZE=block_size,
        BLOCK_H=max(16, triton.next_power_of_2(group)),
        BLOCK_D=block_d,
        BLOCK_N=DECODE_BLOCK_N,
        USE_WINDOW=use_window,
        USE_SOFTCAP=use_softcap,
        DIRECT=direct,
        DOT_PREC=dot_precision(query.dtype),
        UPCAST_DOT=needs_dot_upcast(query.dtype),
        KV_QUANT=quant,
        num_warps=DECODE_NUM_WARPS,
    )
    if not direct:
        _decode_reduce_kernel[(num_seqs, num_q_heads)](
            out,
            part_acc,
            part_m,
            part_l,
            seq_lens,
            query_start_loc,
            seq_indices,
            int(sliding_window) if use_window else 0,
            plan.partition_size,
            out.stride(0),
            out.stride(1),
            part_acc.stride(0),
            part_acc.stride(1),
            part_acc.stride(2),
            num_q_heads,
            plan.num_splits,
            head_dim,
            USE_WINDOW=use_window,
            BLOCK_SPLITS=triton.next_power_of_2(plan.num_splits),
            BLOCK_D=block_d,
        )
    return out

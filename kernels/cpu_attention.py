"""Vectorised paged attention in plain torch, for the CPU backend.

Same semantics as `reference.ref_paged_attention` (varlen, causal, GQA, sliding window, softcap),
but without a Python loop over decode sequences:

* Decode rows (query length 1) are batched: one `index_select` gathers whole cache blocks of all
  decode sequences into a padded [B, L, Hkv, D] buffer (block-granular gather: 1 index per block,
  not per token; with a sliding window only the blocks inside the window), a length mask hides the
  padding, and one attention call does the math.
  Sequences are bucketed by length (max/min <= 2 inside a bucket, short ones together) so one
  long sequence does not pad the whole batch to its length.
* Prefill rows (query length > 1: prompts, chunks, prefix hits) go one sequence at a time through
  SDPA: their work is large per call, so the loop overhead is noise.

Decode math: matmuls in the cache's dtype with an fp32 softmax, GQA heads folded into the rows
(no expanded K/V). For bf16 on this CPU's AMX it is ~15x faster than SDPA's flash kernel with a
mask at query length 1, whose per-row overhead dominates. Decode plans (gather indices, masks) are
built once per step and reused by every layer. Prefill rows use SDPA (causal, or with a mask for
prefix hits and windows); softcap layers take an explicit fp32 matmul + softmax path. (Measured
choices: see `pagedcore bench attention`.)

A quantized cache (`kv_quant`: int8 / fp8 values, a scale per token and KV head) is read by the
C++ decode kernel in place, de-quantized in its inner loop; the torch paths de-quantize what they
gather (the tokens of a prefill row, the blocks of a decode bucket) to the query's dtype.

Cache slots past a sequence's length (the tail of its last block, padding blocks) may hold
anything, NaN included (e.g. a `torch.empty` cache): they are zeroed in the gathered copy, since
even a fully masked score contributes 0 * NaN = NaN to the output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedcore.attention.backend import AttentionMetadata
from pagedcore.kernels import cpu_ext, kv_quant
from pagedcore.kernels.ext_decode_plan import ExtDecodePlan, _ext_plan, prompt_rows_of_one_token


def _bucket_by_length(idx: list[int], lens: list[int], ratio: float = 2.0, floor: int = 128) -> list[list[int]]:
    """Group sequence indices so that within a group max_len <= max(ratio * min_len, floor): padding
    stays bounded, and short sequences (cheap to pad) share one call."""
    order = sorted(idx, key=lambda i: lens[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and lens[i] <= max(ratio * lens[groups[-1][0]], floor):
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def _explicit_attention(q, k, v, mask, scale, softcap):
    """Explicit fp32 matmul + softmax (+ softcap). q [N, Hq, M, D], k/v [N, Hkv, L, D], mask [N|1, 1, M, L].

    GQA without expanding K/V: the query heads of one KV head are folded into the row axis."""
    group = q.shape[1] // k.shape[1]
    n, hkv, length, d = k.shape
    m = q.shape[2]
    qf = q.float().reshape(n, hkv, group * m, d)
    s = torch.matmul(qf, k.float().transpose(-1, -2)).view(n, hkv, group, m, length) * scale
    if softcap is not None and softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~mask.reshape(mask.shape[0], 1, 1, m, length), float("-inf"))
    p = torch.softmax(s, dim=-1).view(n, hkv, group * m, length)
    return torch.matmul(p, v.float()).view(n, hkv * group, m, d)


def _attend(q, k, v, mask, scale, softcap, use_sdpa=True):
    """q [N, Hq, M, D], k/v [N, Hkv, L, D], mask bool [N|1, 1, M, L] (True = visible) -> [N, Hq, M, D] fp32|dtype."""
    if (softcap is not None and softcap > 0) or not use_sdpa:
        return _explicit_attention(q, k, v, mask, scale, softcap)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


@dataclass
class DecodeGroupPlan:
    """One length bucket of decode rows, planned once per step and reused by every layer."""

    rows: torch.Tensor  # query rows of these sequences
    row_start: int | None  # set when the rows are contiguous (a pure-decode batch): no gather of q
    blocks: torch.Tensor  # [n * num_blocks] cache blocks to gather
    length: int  # num_blocks * block_size
    pad_slots: torch.Tensor | None  # flat indices into [n * length] of slots past each sequence's end
    hidden: torch.Tensor  # bool [n, 1, 1, length]: True = key not visible (padding, outside the window)
    hidden_by_head: torch.Tensor | None = None  # see _cross_head_hidden


def plan_decode_group(metadata: AttentionMetadata, seqs: list[int], sliding_window: int | None) -> DecodeGroupPlan:
    block_size = metadata.block_size
    n = len(seqs)
    device = metadata.block_table.device
    lens_list = [metadata.seq_lens_cpu[i] for i in seqs]
    window = sliding_window if sliding_window is not None and sliding_window > 0 else None
    # First block holding a visible key (with a sliding window, older blocks are never gathered).
    first = [max(0, length - window) // block_size if window else 0 for length in lens_list]
    num_blocks = max(-(-length // block_size) - f for length, f in zip(lens_list, first))
    seq_idx = torch.tensor(seqs, dtype=torch.long, device=device)
    cols = torch.tensor(first, dtype=torch.long, device=device)[:, None] + torch.arange(num_blocks, device=device)
    table = metadata.block_table
    blocks = table[seq_idx[:, None], cols.clamp(max=table.shape[1] - 1)].reshape(-1).long()
    length = num_blocks * block_size
    lens = torch.tensor(lens_list, dtype=torch.long, device=device)[:, None]
    pos = (cols[:, :, None] * block_size + torch.arange(block_size, device=device)).view(n, length)  # absolute
    valid = pos < lens
    visible = valid & ((lens - 1 - pos) < window) if window else valid
    pad_slots = None if bool(valid.all()) else (~valid).view(-1).nonzero().squeeze(1)
    rows_list = [metadata.query_start_loc_cpu[i] for i in seqs]
    contiguous = rows_list == list(range(rows_list[0], rows_list[0] + n))
    rows = torch.tensor(rows_list, dtype=torch.long, device=device)
    return DecodeGroupPlan(rows, rows_list[0] if contiguous else None, blocks, length, pad_slots,
                           ~visible[:, None, None, :])


def _gather(cache: torch.Tensor, plan: DecodeGroupPlan, n: int, zero_padding: bool, dtype: torch.dtype) -> torch.Tensor:
    """Whole blocks of every sequence: [n, length, Hkv, D]. Values need their slots past the end zeroed
    (they may be NaN, and even a weight of 0 gives 0 * NaN = NaN); keys need not, since their scores
    are overwritten by the mask. A quantized cache's blocks come de-quantized to `dtype`."""
    if kv_quant.layout_of(cache) is not None:
        data, scales = kv_quant.split(cache)
        x = kv_quant.dequantize(torch.index_select(data, 0, plan.blocks), torch.index_select(scales, 0, plan.blocks),
                                dtype)
    else:
        x = torch.index_select(cache, 0, plan.blocks)
    _, _, num_kv_heads, head_dim = x.shape
    if zero_padding and plan.pad_slots is not None:
        x.view(-1, num_kv_heads, head_dim).index_fill_(0, plan.pad_slots, 0)
    return x.view(n, plan.length, num_kv_heads, head_dim)


def _cross_head_hidden(plan: DecodeGroupPlan, num_q_heads: int, num_kv_heads: int) -> torch.Tensor:
    """bool [n, Hq, length * Hkv]: the scores `_decode_native` must hide -- keys of other KV heads
    (GQA) and the plan's hidden keys. Built once per plan (the first layer) and kept on it."""
    if plan.hidden_by_head is None:
        device = plan.hidden.device
        col_head = torch.arange(plan.length * num_kv_heads, device=device) % num_kv_heads
        row_head = torch.arange(num_q_heads, device=device) // (num_q_heads // num_kv_heads)
        n = plan.hidden.shape[0]
        hidden = plan.hidden.view(n, plan.length, 1).expand(n, plan.length, num_kv_heads).reshape(n, 1, -1)
        plan.hidden_by_head = (row_head[:, None] != col_head[None, :])[None] | hidden
    return plan.hidden_by_head


def _decode_native(q, k, v, hidden_by_head, scale, softcap):
    """q [n, Hq, D], k/v [n, L, Hkv, D] -> [n, Hq, D] in q's dtype.

    Matmuls in the cache dtype (bf16 on AMX: fp32 casts alone cost more than the math), softmax in
    fp32. Every query head is scored against the keys of all KV heads, laid out as gathered
    ([n, L * Hkv, D], contiguous): Hkv times the (tiny) FLOPs, but no transposed copy of K and V,
    which cost more. Other heads' scores are masked to -inf, so their weights are exactly 0."""
    n, length, hkv, d = k.shape
    s = torch.bmm(q, k.view(n, length * hkv, d).transpose(1, 2)).float().mul_(scale)  # [n, Hq, L * Hkv]
    if softcap is not None and softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    s.masked_fill_(hidden_by_head, float("-inf"))
    p = torch.softmax(s, dim=-1).to(v.dtype)
    return torch.bmm(p, v.view(n, length * hkv, d))


def _decode_group(out, query, k_cache, v_cache, plan: DecodeGroupPlan, scale, softcap, use_sdpa):
    n = plan.rows.numel()
    k = _gather(k_cache, plan, n, zero_padding=use_sdpa, dtype=query.dtype)
    v = _gather(v_cache, plan, n, zero_padding=True, dtype=query.dtype)
    q = query[plan.row_start : plan.row_start + n] if plan.row_start is not None else query.index_select(0, plan.rows)
    if use_sdpa:
        o = _attend(q.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2), ~plan.hidden, scale, softcap).squeeze(2)
    else:
        o = _decode_native(q, k, v, _cross_head_hidden(plan, q.shape[1], k.shape[2]), scale, softcap)
    if plan.row_start is not None:
        out[plan.row_start : plan.row_start + n] = o.to(out.dtype)
    else:
        out.index_copy_(0, plan.rows, o.to(out.dtype))


# torch's CPU flash attention runs bf16/fp16 lengths that are a multiple of 32 up to ~1.7x faster than
# lengths just off it (measured, bf16, 9/3 heads of 64: 146 tokens 203 us, 160 tokens 124 us; 191: 278,
# 192: 153). fp32 runs no faster aligned (146: 238 us, 160: 250), so it is not padded.
SDPA_ALIGN = 32


def _padded_len(n: int) -> int:
    return -(-n // SDPA_ALIGN) * SDPA_ALIGN


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """x [n, ...] -> [rows, ...], zeros after x (zeros, not garbage: a NaN there would reach the real
    rows' output through the masked block's arithmetic)."""
    if rows == x.shape[0]:
        return x
    out = x.new_zeros((rows, *x.shape[1:]))
    out[: x.shape[0]] = x
    return out


def _gather_rows(flat: torch.Tensor, slots: torch.Tensor, rows: int) -> torch.Tensor:
    """flat[slots], zero-padded at the end to `rows` rows, in one copy."""
    if rows == slots.numel():
        return flat.index_select(0, slots)
    out = flat.new_empty((rows, *flat.shape[1:]))
    torch.index_select(flat, 0, slots, out=out[: slots.numel()])
    out[slots.numel():].zero_()
    return out


def _prefill_one(out, query, k_cache, v_cache, metadata, i, scale, sliding_window, softcap):
    block_size = metadata.block_size
    start, end = metadata.query_start_loc_cpu[i], metadata.query_start_loc_cpu[i + 1]
    seq_len = metadata.seq_lens_cpu[i]
    q_len = end - start
    device = query.device
    use_window = sliding_window is not None and 0 < sliding_window < seq_len
    plain = q_len == seq_len and not use_window and not (softcap is not None and softcap > 0)
    # Token-granular gather of exactly the context (nothing to zero), except that a plain bf16/fp16 prompt
    # on the CPU is padded at the end to a multiple of SDPA_ALIGN rows (see SDPA_ALIGN).
    aligned = plain and device.type == "cpu" and query.dtype in (torch.bfloat16, torch.float16)
    padded = _padded_len(seq_len) if aligned else seq_len
    pos = torch.arange(seq_len, device=device)
    blocks = metadata.block_table[i].long()[pos // block_size]
    if kv_quant.layout_of(k_cache) is not None:
        k = _pad_rows(kv_quant.gather_tokens(k_cache, blocks, pos % block_size, query.dtype), padded)
        v = _pad_rows(kv_quant.gather_tokens(v_cache, blocks, pos % block_size, query.dtype), padded)
    else:
        slots = blocks * block_size + pos % block_size
        k = _gather_rows(k_cache.flatten(0, 1), slots, padded)
        v = _gather_rows(v_cache.flatten(0, 1), slots, padded)
    k, v = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)  # [1, Hkv, L, D]
    q = _pad_rows(query[start:end], q_len + padded - seq_len).transpose(0, 1).unsqueeze(0)  # [1, Hq, M, D]

    if plain:
        # Plain prompt: SDPA's own causal path (top-left aligned == ours when M == L). Padding rows come
        # after every real row, so causality hides them from the real queries; their outputs are dropped.
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
        o = o[:, :, :q_len]
    else:
        q_pos = torch.arange(seq_len - q_len, seq_len, device=device)[:, None]
        visible = pos[None, :] <= q_pos
        if use_window:
            visible = visible & ((q_pos - pos[None, :]) < sliding_window)
        o = _attend(q, k, v, visible[None, None], scale, softcap)
    out[start:end] = o[0].transpose(0, 1).to(out.dtype)


def _prefill_ext(ext, out, query, k_cache, v_cache, metadata, prompts, scale, sliding_window, softcap) -> list[int]:
    """The prompts the C++ kernel takes (AVX-512 and AVX2 + FMA CPUs: plain causal attention, no window cutting into
    the context, no softcap, the cache in the query's dtype or int8 / fp8 quantized) run in one call; returns the
    others, for _prefill_one."""
    d = query.shape[-1]
    quantized = kv_quant.layout_of(k_cache) is not None
    if softcap or query.dtype not in (torch.float32, torch.bfloat16) or not (quantized or k_cache.dtype == query.dtype) \
            or query.stride(1) != d or out.stride(1) != d \
            or out.stride(2) != 1 or not ext.paged_prefill_supported(d):
        return prompts
    lens, qsl = metadata.seq_lens_cpu, metadata.query_start_loc_cpu
    windowed = [i for i in prompts if sliding_window is not None and 0 < sliding_window < lens[i]]
    take = [i for i in prompts if i not in windowed]
    if take:
        scales = {}
        if quantized:  # de-quantized as K and V are packed
            (k_cache, scales["k_scales"]), (v_cache, scales["v_scales"]) = kv_quant.split(k_cache), kv_quant.split(v_cache)
        ext.paged_prefill(query, out, k_cache, v_cache, metadata.block_table.contiguous(), take,
                          [qsl[i] for i in take], [qsl[i + 1] for i in take], [lens[i] for i in take], scale, **scales)
    return windowed


def _decode_ext(ext, out, query, k_cache, v_cache, plan: ExtDecodePlan, scale, sliding_window, softcap):
    """Decode rows through the C++ kernel, into `out`'s rows; with `out` None, return its output."""
    window = sliding_window if sliding_window is not None and sliding_window > 0 else 0
    softcap = softcap if softcap is not None and softcap > 0 else 0.0
    if kv_quant.layout_of(k_cache) is not None:  # de-quantized in the kernel's inner loop
        (k_data, k_scales), (v_data, v_scales) = kv_quant.split(k_cache), kv_quant.split(v_cache)
        o = ext.paged_decode(query, plan.rows, k_data, v_data, plan.block_table, plan.seq_lens, scale, window,
                             softcap, k_scales, v_scales)
    else:
        o = ext.paged_decode(query, plan.rows, k_cache, v_cache, plan.block_table, plan.seq_lens, scale, window,
                             softcap)
    if out is None:
        return o
    out.index_copy_(0, plan.rows, o.to(out.dtype))
    return out


def plan_decode_groups(metadata: AttentionMetadata, sliding_window: int | None) -> list[DecodeGroupPlan]:
    qsl = metadata.query_start_loc_cpu
    decode = [i for i in range(len(metadata.seq_lens_cpu)) if qsl[i + 1] - qsl[i] == 1]
    if not decode:
        return []
    eff_lens = metadata.seq_lens_cpu
    if sliding_window is not None and sliding_window > 0:
        eff_lens = [min(length, sliding_window) for length in eff_lens]
    return [plan_decode_group(metadata, group, sliding_window) for group in _bucket_by_length(decode, eff_lens)]


def cpu_paged_attention(
    query: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    out: torch.Tensor | None = None,
    use_sdpa: bool = False,
    plans: dict | None = None,
    use_ext: bool = True,
) -> torch.Tensor:
    """Paged varlen attention over the (already written) cache. Returns [T, Hq, D] in query's dtype.

    Rows not owned by any sequence (padding tokens) are zero. Decode rows go through the native-dtype
    matmul path; `use_sdpa=True` sends them through SDPA instead (kept to benchmark the choice).
    With `use_ext` (default) and the C++ kernel built (cpu_ext.py), decode rows go to it instead:
    it reads K/V in place through the block table, with no gathered copy.
    `plans`: a dict kept for one step, so the decode plans are built by the first layer only.
    """
    qsl = metadata.query_start_loc_cpu
    ext = cpu_ext.load() if use_ext and query.device.type == "cpu" and not use_sdpa else None
    use_ext = ext is not None and query.stride(2) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    one_token_prompts = prompt_rows_of_one_token(ext, metadata, query.shape[-1], plans) if use_ext else []
    if use_ext and out is None and not one_token_prompts and 0 < len(qsl) - 1 == qsl[-1] == query.shape[0]:
        # Every row a decode, none padding: the kernel's output is the whole result (no copy into `out`).
        plan = _ext_plan(metadata, plans)
        return _decode_ext(ext, None, query, k_cache, v_cache, plan, scale, sliding_window, softcap)
    if out is None:
        out = torch.zeros_like(query) if qsl[-1] < query.shape[0] else torch.empty_like(query)
    prompts = sorted([i for i in range(len(metadata.seq_lens_cpu)) if qsl[i + 1] - qsl[i] > 1] + one_token_prompts)
    if use_ext and prompts:
        prompts = _prefill_ext(ext, out, query, k_cache, v_cache, metadata, prompts, scale, sliding_window, softcap)
    for i in prompts:
        _prefill_one(out, query, k_cache, v_cache, metadata, i, scale, sliding_window, softcap)
    if use_ext:
        plan = _ext_plan(metadata, plans, one_token_prompts)
        if plan is not None:
            _decode_ext(ext, out, query, k_cache, v_cache, plan, scale, sliding_window, softcap)
        return out
    key = sliding_window if sliding_window is not None and sliding_window > 0 else None
    groups = plans.get(key) if plans is not None else None
    if groups is None:
        groups = plan_decode_groups(metadata, sliding_window)
        if plans is not None:
            plans[key] = groups
    for plan in groups:
        _decode_group(out, query, k_cache, v_cache, plan, scale, softcap, use_sdpa)
    return out

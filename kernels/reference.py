"""Plain-torch reference implementations: slow, loop-per-sequence, obviously correct.

These are the ground truth the Triton kernels (and the vectorised CPU path) are tested against.
Everything is computed in fp32 and cast back to the query dtype at the end, so the reference is
at least as accurate as any kernel under test.
"""

from __future__ import annotations

import torch

from pagedcore.attention.backend import AttentionMetadata


def ref_reshape_and_cache(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # int64 [T]; slot < 0 is padding and is skipped
) -> None:
    """Write token t's key/value into slot `slot_mapping[t]` (block = slot // bs, offset = slot % bs)."""
    block_size = k_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        k_cache[slot // block_size, slot % block_size] = key[t]
        v_cache[slot // block_size, slot % block_size] = value[t]


def gather_context(cache: torch.Tensor, block_row: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first `seq_len` tokens of one sequence's K (or V) through its block-table row: [L, Hkv, D]."""
    block_size = cache.shape[1]
    pos = torch.arange(seq_len)
    blocks = block_row.cpu().long()[pos // block_size]
    return cache[blocks.to(cache.device), (pos % block_size).to(cache.device)]


def ref_attention_one_seq(
    q: torch.Tensor,  # [Lq, Hq, D]
    k: torch.Tensor,  # [L, Hkv, D]  whole context, positions 0..L-1
    v: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of the last Lq positions of a length-L context, in fp32: [Lq, Hq, D]."""
    lq, hq, _ = q.shape
    seq_len, hkv, _ = k.shape
    group = hq // hkv
    qf = q.float()
    # GQA: query head h reads kv head h // group.
    kf = k.float().repeat_interleave(group, dim=1)
    vf = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", qf, kf) * scale
    if softcap is not None and softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    q_pos = torch.arange(seq_len - lq, seq_len, device=q.device)[:, None]
    k_pos = torch.arange(seq_len, device=q.device)[None, :]
    visible = k_pos <= q_pos
    if sliding_window is not None and sliding_window > 0:
        visible &= (q_pos - k_pos) < sliding_window
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, vf)


def ref_paged_attention(
    query: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Varlen paged attention: every query token attends causally to its sequence's cached context.

    Reads K/V only through `metadata.block_table` (the cache must already hold this step's tokens).
    Returns [T, Hq, D] in query's dtype.
    """
    out = torch.zeros(query.shape, dtype=torch.float32, device=query.device)
    qsl = metadata.query_start_loc_cpu
    for i, seq_len in enumerate(metadata.seq_lens_cpu):
        start, end = qsl[i], qsl[i + 1]
        if end == start:
            continue
        k = gather_context(k_cache, metadata.block_table[i], seq_len)
        v = gather_context(v_cache, metadata.block_table[i], seq_len)
        out[start:end] = ref_attention_one_seq(query[start:end], k, v, scale, sliding_window, softcap)
    return out.to(query.dtype)


def ref_copy_blocks(
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]], src: torch.Tensor, dst: torch.Tensor
) -> None:
    """Copy block src[i] -> dst[i] in every layer's K and V cache (copy-on-write)."""
    for k_cache, v_cache in kv_caches:
        for s, d in zip(src.tolist(), dst.tolist()):
            k_cache[d] = k_cache[s]
            v_cache[d] = v_cache[s]


def ref_swap_blocks(src_cache: torch.Tensor, dst_cache: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Copy block src -> dst for each (src, dst) row of `block_mapping` [N, 2], across pools/devices."""
    for s, d in block_mapping.tolist():
        dst_cache[d] = src_cache[s].to(dst_cache.device)

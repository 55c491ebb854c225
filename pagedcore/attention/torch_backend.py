"""The torch attention backend: the CPU path (and a portable fallback on any device).

Decode rows (one query token) are batched into one gather + two batched matmuls with a length
mask; rows with several query tokens (prefill chunks) run SDPA per sequence, since they are
few per step and each is large.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedcore.attention.backend import AttentionBackend, AttentionMetadata


def write_kv_cache(key, value, k_cache, v_cache, slot_mapping) -> None:
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


def _visible(q_pos: torch.Tensor, k_pos: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= (q_pos - k_pos) < sliding_window
    return mask


def _softmax_attend(scores, v, mask, softcap):
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
    return probs @ v


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def build_metadata(self, common: AttentionMetadata) -> AttentionMetadata:
        qsl = common.query_start_loc_cpu
        common.decode_rows = [i for i in range(len(qsl) - 1) if qsl[i + 1] - qsl[i] == 1]
        common.prefill_rows = [i for i in range(len(qsl) - 1) if qsl[i + 1] - qsl[i] > 1]
        if common.decode_rows:
            rows = torch.tensor(common.decode_rows, device=common.seq_lens.device)
            common.decode_token_idx = torch.tensor([qsl[i] for i in common.decode_rows], device=rows.device)
            max_len = max(common.seq_lens_cpu[i] for i in common.decode_rows)
            nblk = -(-max_len // common.block_size)
            common.decode_block_table = common.block_table[rows, :nblk]
            seq_lens = common.seq_lens[rows]
            k_pos = torch.arange(nblk * common.block_size, device=rows.device)
            common.decode_q_pos = (seq_lens - 1)[:, None]
            common.decode_k_pos = k_pos[None, :]
        return common

    def forward(self, query, key, value, k_cache, v_cache, metadata, scale, sliding_window=None, softcap=None):
        write_kv_cache(key, value, k_cache, v_cache, metadata.slot_mapping)
        out = torch.empty_like(query)
        if metadata.decode_rows:
            idx = metadata.decode_token_idx
            out[idx] = self._decode(query[idx], k_cache, v_cache, metadata, scale, sliding_window, softcap)
        for i in metadata.prefill_rows:
            start, end = metadata.query_start_loc_cpu[i], metadata.query_start_loc_cpu[i + 1]
            out[start:end] = self._prefill_one(query[start:end], k_cache, v_cache, metadata, i, scale,
                                               sliding_window, softcap)
        return out

    def _decode(self, q, k_cache, v_cache, md, scale, sliding_window, softcap):
        b, hq, d = q.shape
        hkv = k_cache.shape[2]
        k = k_cache[md.decode_block_table].flatten(1, 2)  # [B, L, Hkv, D]
        v = v_cache[md.decode_block_table].flatten(1, 2)
        q = q.view(b, hkv, hq // hkv, d)  # query heads grouped under their KV head
        scores = torch.einsum("bhgd,blhd->bhgl", q, k.to(q.dtype)) * scale
        mask = _visible(md.decode_q_pos, md.decode_k_pos, sliding_window)[:, None, None, :]
        out = _softmax_attend(scores, v.to(q.dtype).permute(0, 2, 1, 3), mask, softcap)  # [B, Hkv, G, D]
        return out.reshape(b, hq, d)

    def _prefill_one(self, q, k_cache, v_cache, md, i, scale, sliding_window, softcap):
        seq_len = md.seq_lens_cpu[i]
        q_len = q.shape[0]
        nblk = -(-seq_len // md.block_size)
        blocks = md.block_table[i, :nblk]
        k = k_cache[blocks].flatten(0, 1)[:seq_len].to(q.dtype)  # [L, Hkv, D]
        v = v_cache[blocks].flatten(0, 1)[:seq_len].to(q.dtype)
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
        k_pos = torch.arange(seq_len, device=q.device)[None, :]
        mask = _visible(q_pos, k_pos, sliding_window)
        qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
        if softcap is None:
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale,
                                               enable_gqa=qh.shape[0] != kh.shape[0])
            return o.transpose(0, 1)
        group = qh.shape[0] // kh.shape[0]
        kh, vh = kh.repeat_interleave(group, 0), vh.repeat_interleave(group, 0)
        return _softmax_attend(qh @ kh.transpose(1, 2) * scale, vh, mask, softcap).transpose(0, 1)

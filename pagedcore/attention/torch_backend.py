"""The torch attention backend: the CPU path (and a portable fallback on any device).

The math lives in `pagedcore.kernels.cpu_attention` beside the Triton kernels it mirrors: decode
rows batched into one block-granular gather + SDPA, prefill rows through SDPA per sequence.

Short queries (speculative verification: k + 1 tokens per sequence; tiny prefill chunks) run as
decode rows: their K/V are written first, so query token j of a sequence attends to the cache up
to its own position, exactly the causal prefill. One batched decode call then replaces a
gather + SDPA per sequence and layer, which costs more than the math at this size. Where the C++
prefill kernel runs (AVX-512), short chunks of prompt tokens stay prompt rows: that kernel reads the
cache in place (no gather), and a prompt then gets the same values whether it runs whole or as the
tail after a prefix-cache hit (the decode kernel's sums differ from it in last bits, which int8 KV
turned into greedy runs parting). Chunks of generated tokens (verification) stay decode rows, so
that they match the plain decode steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedcore.attention.backend import AttentionBackend, AttentionMetadata
from pagedcore.kernels import cpu_ext, kv_quant
from pagedcore.kernels.cpu_attention import cpu_paged_attention


def write_kv_cache(key, value, k_cache, v_cache, slot_mapping) -> None:
    ext = cpu_ext.load() if key.device.type == "cpu" else None
    if kv_quant.layout_of(k_cache) is not None:  # quantize on write (kernels/kv_quant.py)
        if ext is not None:
            k_data, k_scales = kv_quant.split(k_cache)
            v_data, v_scales = kv_quant.split(v_cache)
            ext.write_kv_cache_quant(key, value, k_data, v_data, k_scales, v_scales, slot_mapping)
        else:
            kv_quant.write(key, value, k_cache, v_cache, slot_mapping)
        return
    if ext is not None and k_cache.is_contiguous() and v_cache.is_contiguous():
        ext.write_kv_cache(key.to(k_cache.dtype), value.to(v_cache.dtype), k_cache, v_cache, slot_mapping)
        return
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


# Queries up to this long run as one decode row per token (see above).
SHORT_QUERY_MAX = 16


def split_short_queries(md: AttentionMetadata, max_len: int = SHORT_QUERY_MAX,
                        keep_prompts: bool = False) -> AttentionMetadata:
    """The same attention with every query of 2..max_len tokens as that many one-token rows, token j
    seeing the context up to its own position; with `keep_prompts`, not the queries wholly inside their
    prompt (md.num_prompt_tokens_cpu). `md` itself when there is none to split."""
    qsl, lens = md.query_start_loc_cpu, md.seq_lens_cpu
    q_lens = [qsl[i + 1] - qsl[i] for i in range(len(lens))]
    prompts = md.num_prompt_tokens_cpu if keep_prompts else None
    split = [1 < n <= max_len and not (prompts is not None and lens[i] <= prompts[i]) for i, n in enumerate(q_lens)]
    if not any(split):
        return md
    rows, new_qsl, new_lens = [], [0], []
    for i, n in enumerate(q_lens):
        if split[i]:
            rows += [i] * n
            new_lens += range(lens[i] - n + 1, lens[i] + 1)
            new_qsl += range(new_qsl[-1] + 1, new_qsl[-1] + n + 1)
        else:
            rows.append(i)
            new_lens.append(lens[i])
            new_qsl.append(new_qsl[-1] + n)
    dev = md.seq_lens.device
    index = torch.tensor(rows, dtype=torch.long, device=md.block_table.device)
    return AttentionMetadata(
        num_tokens=md.num_tokens, query_start_loc=torch.tensor(new_qsl, dtype=torch.int32, device=dev),
        seq_lens=torch.tensor(new_lens, dtype=torch.int32, device=dev), block_table=md.block_table[index],
        slot_mapping=md.slot_mapping, max_query_len=max((n for n, s in zip(q_lens, split) if not s), default=1),
        max_seq_len=md.max_seq_len, query_start_loc_cpu=new_qsl, seq_lens_cpu=new_lens, block_size=md.block_size,
        num_prompt_tokens_cpu=None if md.num_prompt_tokens_cpu is None else
        [md.num_prompt_tokens_cpu[i] for i in rows])


def _prefill_kernel_runs(md: AttentionMetadata) -> bool:
    """Whether the C++ prefill kernel runs here (AVX-512; head sizes that are multiples of 16, as most are)."""
    if md.block_table.device.type != "cpu":
        return False
    ext = cpu_ext.load()
    return ext is not None and ext.paged_prefill_supported(64)


@dataclass
class TorchAttentionMetadata:
    common: AttentionMetadata
    decode_plans: dict = field(default_factory=dict)  # sliding window -> plans, filled by the first layer


class TorchAttentionBackend(AttentionBackend):
    name = "torch"
    kv_cache_dtypes = kv_quant.KV_CACHE_DTYPES

    def build_metadata(self, common: AttentionMetadata) -> TorchAttentionMetadata:
        return TorchAttentionMetadata(split_short_queries(common, keep_prompts=_prefill_kernel_runs(common)))

    def forward(self, query, key, value, k_cache, v_cache, metadata, scale,
                sliding_window=None, softcap=None) -> torch.Tensor:
        if isinstance(metadata, AttentionMetadata):  # called without build_metadata (tests, plugins)
            metadata = TorchAttentionMetadata(metadata)
        write_kv_cache(key, value, k_cache, v_cache, metadata.common.slot_mapping)
        return cpu_paged_attention(query, k_cache, v_cache, metadata.common, scale, sliding_window, softcap,
                                   plans=metadata.decode_plans)

"""Random paged batches for the kernel tests and the benchmark.

`make_paged_batch` builds a step exactly as the model runner would describe it: sequences with a
cached prefix (already in the cache) plus `query_len` new tokens, physical blocks handed out in a
shuffled order (so a sequence's blocks are never contiguous), block-table rows padded with block 0.

Every cache slot that holds no real token -- block 0 (the padding target), the tail of each
sequence's last block, unused blocks -- is poisoned with NaN: a kernel that reads past `seq_len`
or through a padding block-table entry produces NaN and fails the test.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedcore.attention.backend import AttentionMetadata
from pagedcore.kernels.reference import ref_reshape_and_cache


@dataclass
class PagedBatch:
    query: torch.Tensor  # [T, Hq, D]
    key: torch.Tensor  # [T, Hkv, D] this step's new keys
    value: torch.Tensor
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]; prefix written, new tokens not yet
    v_cache: torch.Tensor
    metadata: AttentionMetadata

    def write_new_tokens(self) -> None:
        """Put this step's K/V into the cache with the reference writer (for attention-only tests)."""
        ref_reshape_and_cache(self.key, self.value, self.k_cache, self.v_cache, self.metadata.slot_mapping)


def make_paged_batch(
    query_lens: list[int],
    seq_lens: list[int],
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int | None = None,
    extra_blocks: int = 2,
    num_padding_tokens: int = 0,
    poison: bool = True,
) -> PagedBatch:
    """A random step. Sequence i has `seq_lens[i] - query_lens[i]` cached tokens and `query_lens[i]`
    new ones; `num_padding_tokens` extra rows at the end of the batch have slot -1 (padding)."""
    assert len(query_lens) == len(seq_lens)
    assert all(0 <= q <= s for q, s in zip(query_lens, seq_lens))
    gen = torch.Generator()
    if seed is not None:
        gen.manual_seed(seed)
    else:
        gen.seed()  # non-deterministic, without touching the global RNG

    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = 1 + sum(blocks_per_seq) + extra_blocks  # block 0 = padding target, never owned
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    max_blocks = max(blocks_per_seq + [1])
    block_table = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    next_block = 0
    for i, nb in enumerate(blocks_per_seq):
        block_table[i, :nb] = torch.tensor(order[next_block : next_block + nb], dtype=torch.int32)
        next_block += nb

    fill = float("nan") if poison else 0.0
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(cache_shape, fill, dtype=dtype)
    v_cache = torch.full(cache_shape, fill, dtype=dtype)

    num_tokens = sum(query_lens) + num_padding_tokens
    query = torch.randn(num_tokens, num_q_heads, head_dim, generator=gen).to(dtype)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)

    # Slot of every context position of every sequence, through the block table.
    slot_mapping = torch.full((num_tokens,), -1, dtype=torch.int64)
    query_start_loc = [0]
    prefix_slots = []
    for i, (ql, sl) in enumerate(zip(query_lens, seq_lens)):
        pos = torch.arange(sl)
        slots = block_table[i, pos // block_size].long() * block_size + pos % block_size
        prefix_slots.append(slots[: sl - ql])  # cached prefix: already in the cache
        slot_mapping[query_start_loc[-1] : query_start_loc[-1] + ql] = slots[sl - ql :]
        query_start_loc.append(query_start_loc[-1] + ql)
    prefix = torch.cat(prefix_slots) if prefix_slots else torch.zeros(0, dtype=torch.int64)
    k_cache.view(-1, num_kv_heads, head_dim)[prefix] = torch.randn(len(prefix), num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache.view(-1, num_kv_heads, head_dim)[prefix] = torch.randn(len(prefix), num_kv_heads, head_dim, generator=gen).to(dtype)

    dev = torch.device(device)
    metadata = AttentionMetadata(
        num_tokens=num_tokens,
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=dev),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
        block_table=block_table.to(dev),
        slot_mapping=slot_mapping.to(dev),
        max_query_len=max(query_lens + [0]),
        max_seq_len=max(seq_lens + [0]),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=list(seq_lens),
        block_size=block_size,
    )
    return PagedBatch(
        query=query.to(dev),
        key=key.to(dev),
        value=value.to(dev),
        k_cache=k_cache.to(dev),
        v_cache=v_cache.to(dev),
        metadata=metadata,
    )


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref|, in fp32."""
    out, ref = out.float(), ref.float()
    return float((out - ref).abs().max() / ref.abs().max().clamp_min(1e-6))


def draw_batch_spec(draw, mode: str, max_seqs: int = 4, max_decode_len: int = 300, max_prompt: int = 80):
    """Hypothesis helper: (query_lens, seq_lens) for a step.

    mode "decode": every sequence has one new token (contexts crossing many block boundaries);
    "prefill": fresh prompts (no cached prefix); "mixed": decode rows, fresh prompts and chunks
    with a cached prefix (chunked prefill / prefix-cache hit) in one batch.
    """
    from hypothesis import strategies as st

    n = draw(st.integers(1, max_seqs))
    query_lens, seq_lens = [], []
    for _ in range(n):
        kind = mode if mode != "mixed" else draw(st.sampled_from(["decode", "prefill", "chunk"]))
        if kind == "decode":
            q, s = 1, draw(st.integers(1, max_decode_len))
        elif kind == "prefill":
            q = draw(st.integers(2, max_prompt))
            s = q
        else:
            q = draw(st.integers(2, max_prompt // 2))
            s = q + draw(st.integers(1, max_prompt))
        query_lens.append(q)
        seq_lens.append(s)
    return query_lens, seq_lens


def tolerance(dtype: torch.dtype) -> float:
    """Max relative error accepted vs the fp32 reference on the same (rounded) inputs."""
    return 1e-4 if dtype == torch.float32 else 2e-2

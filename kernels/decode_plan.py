"""How a Triton decode launch (kernels/decode_attention.py) is cut: the split-K plan, from host-side ints only.

With few sequences, (sequences x KV heads) programs cannot fill a GPU, so each sequence's context is cut into
partitions that run in parallel and a second kernel combines them (flash-decoding)."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton

from pagedcore.kernels.triton_utils import interpreting

# Tokens per inner-loop tile. Independent of the cache block size (8/16/32): every token's slot is
# looked up individually, so a tile may span several cache blocks. 32 tokens x 4 warps compiles
# without register spills for head_dim <= 128 in fp32/fp16/bf16 on sm_90 (checked with ptxas:
# 64-token tiles spill at head_dim 128 -- the gathered K/V tiles need 64-bit pointers per element).
DECODE_BLOCK_N = 32
# Splitting a partition below this many tokens costs more in the reduction than it buys.
MIN_PARTITION_SIZE = 256


@dataclass(frozen=True)
class DecodePlan:
    """How one decode launch is cut: `num_splits` partitions of `partition_size` tokens each."""

    num_splits: int
    partition_size: int


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def default_num_programs_target() -> int:
    """Programs needed to keep the device busy: a few per SM on GPU, one per core in the interpreter."""
    if torch.cuda.is_available() and not interpreting():
        return 4 * _sm_count(torch.cuda.current_device())
    return os.cpu_count() or 1


def plan_decode(
    num_seqs: int,
    num_kv_heads: int,
    max_context: int,
    target_programs: int | None = None,
    num_splits: int | None = None,
    block_n: int = DECODE_BLOCK_N,
) -> DecodePlan:
    """Pick the split count for a decode launch (host-side ints only: no device sync).

    Enough sequences x KV heads already fill the device -> 1 split (no reduction pass). Otherwise
    split so that about `target_programs` programs run, but keep partitions >= MIN_PARTITION_SIZE.
    The split count is rounded to a power of two so the reduction kernel compiles few variants;
    the partition size is a runtime argument and never triggers recompilation.
    """
    max_context = max(int(max_context), 1)
    if num_splits is None:
        if target_programs is None:
            target_programs = default_num_programs_target()
        base = max(num_seqs * num_kv_heads, 1)
        want = triton.cdiv(target_programs, base)
        cap = max(max_context // MIN_PARTITION_SIZE, 1)
        # Smallest power of two >= want, unless partitions would get too short.
        num_splits = 1
        while num_splits < want and num_splits * 2 <= cap:
            num_splits *= 2
    num_splits = max(1, min(int(num_splits), triton.cdiv(max_context, block_n)))
    partition_size = triton.cdiv(triton.cdiv(max_context, num_splits), block_n) * block_n
    num_splits = triton.cdiv(max_context, partition_size)  # rounding may leave a split unused
    return DecodePlan(num_splits=num_splits, partition_size=partition_size)

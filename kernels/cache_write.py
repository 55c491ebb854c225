"""Write this step's new K/V into the paged cache (vLLM's `reshape_and_cache`).

One program per token copies its [num_kv_heads, head_dim] key and value rows into slot
`slot_mapping[t]`, i.e. block `slot // block_size`, offset `slot % block_size`. A negative slot
marks a padding token (e.g. CUDA-graph padding): it is skipped, never written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedcore.kernels import triton_utils  # noqa: F401 (picks the interpreter before the first @triton.jit)


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,  # cache strides: block, slot-in-block, head (head_dim is contiguous)
    stride_cs,
    stride_ch,
    num_kv_heads,
    head_dim,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if slot < 0:
        return  # padding token
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    # head_dim / num_kv_heads need not be powers of two: the tile is padded and masked.
    mask = (offs_h[:, None] < num_kv_heads) & (offs_d[None, :] < head_dim)

    t64 = t.to(tl.int64)
    k = tl.load(key_ptr + t64 * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(value_ptr + t64 * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)

    # int64 address math: block * stride_cb overflows int32 for caches beyond 2^31 elements.
    dst = block * stride_cb + offset * stride_cs + offs_h[:, None] * stride_ch + offs_d[None, :]
    # tl.store casts to the cache's element type.
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def reshape_and_cache(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # int [T]; < 0 = skip
) -> None:
    """Scatter key/value rows into the paged K/V caches in place."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    assert value.shape == key.shape
    assert k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride()
    assert k_cache.shape[2:] == (num_kv_heads, head_dim)
    # The kernel assumes head_dim is the contiguous axis (it is for any sane layout).
    assert key.stride(2) == 1 and value.stride(2) == 1 and k_cache.stride(3) == 1
    assert slot_mapping.shape[0] >= num_tokens
    _reshape_and_cache_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        num_kv_heads,
        head_dim,
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )

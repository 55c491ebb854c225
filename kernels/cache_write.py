"""Write this step's new K/V into the paged cache (vLLM's `reshape_and_cache`).

One program per token copies its [num_kv_heads, head_dim] key and value rows into slot
`slot_mapping[t]`, i.e. block `slot // block_size`, offset `slot % block_size`. A negative slot
marks a padding token (e.g. CUDA-graph padding): it is skipped, never written.

Quantized cache (QUANT, kernels/kv_quant.py is the reference): each (token, KV head) row is stored as
int8 (QUANT 1) or e4m3 (QUANT 2) values with scale = fp16(max|row| / qmax), written beside it. The
scale is the row's own, known the moment the token arrives: no later write can outgrow it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedcore.kernels import triton_utils  # noqa: F401 (picks the interpreter before the first @triton.jit)
from pagedcore.kernels.triton_utils import check_scales


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,  # fp16 [num_blocks, block_size, Hkv] (used when QUANT)
    v_scale_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,  # cache strides: block, slot-in-block, head (head_dim is contiguous)
    stride_cs,
    stride_ch,
    stride_sb,  # scale strides: block, slot-in-block (the head's is 1)
    stride_ss,
    num_kv_heads,
    head_dim,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    QUANT: tl.constexpr,  # 0: the model dtype; 1: int8; 2: fp8 e4m3
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
    if QUANT:
        s_dst = block * stride_sb + offset * stride_ss + offs_h
        _store_quantized(k, k_cache_ptr + dst, k_scale_ptr + s_dst, mask, offs_h < num_kv_heads, QUANT)
        _store_quantized(v, v_cache_ptr + dst, v_scale_ptr + s_dst, mask, offs_h < num_kv_heads, QUANT)
    else:
        # tl.store casts to the cache's element type.
        tl.store(k_cache_ptr + dst, k, mask=mask)
        tl.store(v_cache_ptr + dst, v, mask=mask)


@triton.jit
def _round_to_e4m3(y):
    """y (fp32, |y| <= 448) rounded to nearest-even on e4m3's 3 mantissa bits, still fp32, so the cast to
    e4m3 after it is exact for normals. The cast alone rounds the same on GPUs, but Triton's interpreter
    drops the carry when a mantissa rounds up into the next power of two (-127.9 -> -64)."""
    bits = y.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576  # drop fp32's low 20 mantissa bits, ties to even
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _store_quantized(x, data_ptrs, scale_ptrs, mask, head_mask, QUANT: tl.constexpr):
    """Rows x [BLOCK_H, BLOCK_D] -> values at data_ptrs, one fp16 scale per row at scale_ptrs."""
    x = tl.where(mask, x.to(tl.float32), 0.0)
    if QUANT == 1:
        qmax = 127.0
    else:
        qmax = 448.0
    scale = tl.minimum(tl.max(tl.abs(x), axis=1) / qmax, 65504.0).to(tl.float16)
    s = scale.to(tl.float32)
    y = tl.where(s[:, None] > 0.0, x / tl.where(s > 0.0, s, 1.0)[:, None], 0.0)
    if QUANT == 1:
        q = tl.minimum(tl.maximum(tl.floor(y + 0.5), -127.0), 127.0).to(tl.int8)
    else:
        q = _round_to_e4m3(tl.minimum(tl.maximum(y, -448.0), 448.0)).to(tl.float8e4nv)
    tl.store(data_ptrs, q, mask=mask)
    tl.store(scale_ptrs, scale, mask=head_mask)


def reshape_and_cache(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # int [T]; < 0 = skip
    k_scales: torch.Tensor | None = None,  # fp16 [num_blocks, block_size, Hkv]: quantize into int8 / fp8 caches
    v_scales: torch.Tensor | None = None,
) -> None:
    """Scatter key/value rows into the paged K/V caches in place (quantized, with scales, for an int8 /
    fp8 cache: kv_quant.split's views)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    assert value.shape == key.shape
    assert k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride()
    assert k_cache.shape[2:] == (num_kv_heads, head_dim)
    # The kernel assumes head_dim is the contiguous axis (it is for any sane layout).
    assert key.stride(2) == 1 and value.stride(2) == 1 and k_cache.stride(3) == 1
    assert slot_mapping.shape[0] >= num_tokens
    quant = check_scales(k_cache, v_cache, k_scales, v_scales)
    _reshape_and_cache_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        k_scales if quant else k_cache,
        v_scales if quant else v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        k_scales.stride(0) if quant else 0,
        k_scales.stride(1) if quant else 0,
        num_kv_heads,
        head_dim,
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        QUANT=0 if not quant else (1 if k_cache.dtype == torch.int8 else 2),
    )

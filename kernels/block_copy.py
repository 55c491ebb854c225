"""Whole-block copies in the paged KV cache.

* `copy_blocks`: copy-on-write inside one pool. When a shared (prefix / beam) block must diverge,
  the scheduler allocates a fresh block and asks for src -> dst in *every* layer's K and V cache.
  One Triton launch does all layers: the caches' base addresses go in as an int64 array (vLLM's
  CUDA copy_blocks does the same with a pointer array), program (pair, cache, chunk) copies one
  contiguous chunk of one block. A quantized cache (uint8 [num_blocks, block_bytes], kernels/kv_quant.py)
  is copied as bytes: each block holds its scales, so they move with it.
* `swap_blocks`: move blocks between two pools (GPU <-> pinned CPU for preemption by swapping).
  That is a DMA job, not a kernel: same device -> one indexed copy; across devices -> one
  `copy_(non_blocking=True)` per block, which becomes a cudaMemcpyAsync without a staging gather.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedcore.kernels.triton_utils import torch_dtype_to_tl

COPY_CHUNK = 1024  # elements per program


@triton.jit
def _copy_blocks_kernel(
    cache_ptrs,  # int64 [num_caches]: data_ptr of every K and V cache (all same shape/dtype)
    pairs_ptr,  # int64 [num_pairs, 2]: (src, dst) block ids
    stride_block,  # elements between consecutive blocks
    block_numel,  # elements in one block (block_size * Hkv * D, contiguous)
    DTYPE: tl.constexpr,
    CHUNK: tl.constexpr,
):
    pair = tl.program_id(0)
    cache = tl.program_id(1)
    chunk = tl.program_id(2)
    base = tl.load(cache_ptrs + cache).to(tl.pointer_type(DTYPE))
    src = tl.load(pairs_ptr + 2 * pair)
    dst = tl.load(pairs_ptr + 2 * pair + 1)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = offs < block_numel
    vals = tl.load(base + src * stride_block + offs, mask=mask)
    tl.store(base + dst * stride_block + offs, vals, mask=mask)


def _as_index(x, device) -> torch.Tensor:
    return torch.as_tensor(x, dtype=torch.int64, device=device).reshape(-1)


def copy_blocks(
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer (k_cache, v_cache)
    src: torch.Tensor,  # [N] block ids
    dst: torch.Tensor,  # [N] block ids, disjoint from src (fresh copy-on-write blocks)
) -> None:
    """Copy block src[i] -> dst[i] in every layer's K and V cache, in one launch.

    Copies run in parallel, so (as in vLLM) no dst block may also appear as a src block.
    """
    if not kv_caches:
        return
    caches = [c for kv in kv_caches for c in kv]
    first = caches[0]
    device = first.device
    src = _as_index(src, device)
    dst = _as_index(dst, device)
    assert src.shape == dst.shape
    if src.numel() == 0:
        return
    for c in caches:
        assert c.shape == first.shape and c.dtype == first.dtype and c.stride() == first.stride()
        assert c.device == device
    # Within a block the layout [block_size, Hkv, D] must be dense so a block is one flat range.
    block_numel = first[0].numel()
    assert first[0].is_contiguous(), "cache blocks must be contiguous"
    if first.dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.uint8):
        for c in caches:  # any other element type: plain indexed copy
            c[dst] = c[src]
        return

    cache_ptrs = torch.tensor([c.data_ptr() for c in caches], dtype=torch.int64, device=device)
    pairs = torch.stack([src, dst], dim=1).contiguous()
    grid = (pairs.shape[0], len(caches), triton.cdiv(block_numel, COPY_CHUNK))
    _copy_blocks_kernel[grid](
        cache_ptrs,
        pairs,
        first.stride(0),
        block_numel,
        DTYPE=torch_dtype_to_tl(first.dtype),
        CHUNK=COPY_CHUNK,
    )


def swap_blocks(
    src_cache: torch.Tensor,  # [num_blocks_a, ...] one layer's K (or V) cache in pool A
    dst_cache: torch.Tensor,  # [num_blocks_b, ...] the same layer's cache in pool B
    block_mapping: torch.Tensor,  # [N, 2] (src block in A, dst block in B)
) -> None:
    """Copy blocks between two pools, possibly on different devices (swap-out / swap-in)."""
    assert src_cache.shape[1:] == dst_cache.shape[1:] and src_cache.dtype == dst_cache.dtype
    mapping = torch.as_tensor(block_mapping, dtype=torch.int64).reshape(-1, 2)
    if mapping.shape[0] == 0:
        return
    if src_cache.device == dst_cache.device:
        m = mapping.to(src_cache.device)
        dst_cache[m[:, 1]] = src_cache[m[:, 0]]
        return
    # Cross-device: per-block async copies (pinned host memory makes them truly asynchronous).
    for s, d in mapping.tolist():
        dst_cache[d].copy_(src_cache[s], non_blocking=True)

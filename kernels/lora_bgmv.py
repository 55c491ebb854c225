"""BGMV for multi-LoRA on CUDA (Punica's batched gather matrix-vector product, vLLM's shrink/expand).

Each token t of the flattened batch carries its adapter slot s_t (-1: the base model). A LoRA
linear adds y[t] += B[s_t] @ (A[s_t] @ x[t]) with the slot buffers of lora/layers.py:
A [max_loras, R, in], B [max_loras, out, R] (zero-padded to R = max_lora_rank, scale folded into B).
* shrink: program t reduces x[t] against A[s_t] in BLOCK_K chunks -> h[t] [R], fp32.
* expand: program (t, block of out) adds B[s_t] @ h[t] to y[t] in place, rounding once.
Tokens of the base model do nothing (their programs exit), so a mixed batch pays only for its
adapter tokens. One token per program is the decode shape; a prefill's tokens run the same way
(correct, not tuned: vLLM's SGMV tiles several tokens of one segment per program).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Each program's tile of A ([BLOCK_R, BLOCK_K]) or B ([BLOCK_N, BLOCK_R]) stays near 4096 elements
# (32 fp32 registers a thread at 4 warps): fixed 128-wide blocks spill at rank 64 on sm_90 (aot_check).
TILE = 4096


def shrink_block_k(block_r: int) -> int:
    return min(256, max(16, TILE // block_r))


def expand_block_n(block_r: int) -> int:
    return min(128, max(16, TILE // block_r))


@triton.jit
def _bgmv_shrink_kernel(
    x_ptr,  # [T, in]
    a_ptr,  # [S, R, in], contiguous
    slots_ptr,  # int64 [T]
    h_ptr,  # fp32 [T, R] out
    in_features,
    stride_xt,
    RANK: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    t = tl.program_id(0)
    s = tl.load(slots_ptr + t)
    if s >= 0:
        offs_r = tl.arange(0, BLOCK_R)
        r_mask = offs_r < RANK
        acc = tl.zeros([BLOCK_R], dtype=tl.float32)
        a_base = a_ptr + s * (RANK * in_features)
        for k0 in range(0, in_features, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < in_features
            xv = tl.load(x_ptr + t * stride_xt + offs_k, mask=k_mask, other=0.0).to(tl.float32)
            av = tl.load(a_base + offs_r[:, None] * in_features + offs_k[None, :],
                         mask=r_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(av * xv[None, :], axis=1)
        tl.store(h_ptr + t * RANK + offs_r, acc, mask=r_mask)


@triton.jit
def _bgmv_expand_kernel(
    h_ptr,  # fp32 [T, R]
    b_ptr,  # [S, out, R], contiguous
    slots_ptr,  # int64 [T]
    y_ptr,  # [T, out], updated in place
    out_features,
    stride_yt,
    RANK: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    t = tl.program_id(0)
    s = tl.load(slots_ptr + t)
    if s >= 0:
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < out_features
        offs_r = tl.arange(0, BLOCK_R)
        r_mask = offs_r < RANK
        h = tl.load(h_ptr + t * RANK + offs_r, mask=r_mask, other=0.0)
        bv = tl.load(b_ptr + s * (out_features * RANK) + offs_n[:, None] * RANK + offs_r[None, :],
                     mask=n_mask[:, None] & r_mask[None, :], other=0.0).to(tl.float32)
        delta = tl.sum(bv * h[None, :], axis=1)
        y = tl.load(y_ptr + t * stride_yt + offs_n, mask=n_mask, other=0.0)
        tl.store(y_ptr + t * stride_yt + offs_n, (y.to(tl.float32) + delta).to(y.dtype), mask=n_mask)


def available() -> bool:
    return torch.cuda.is_available()


def add_lora(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             token_slots: torch.Tensor) -> torch.Tensor:
    """y [T, out] += B[s_t] @ (A[s_t] @ x[t]) per token with s_t >= 0, in place; returns y."""
    num_tokens, in_features = x.shape
    rank, out_features = a.shape[1], b.shape[1]
    assert a.shape[2] == in_features and b.shape[2] == rank and y.shape == (num_tokens, out_features)
    assert a.is_contiguous() and b.is_contiguous() and y.stride(1) == 1
    if x.stride(1) != 1:
        x = x.contiguous()
    if num_tokens == 0:
        return y
    slots = token_slots.to(torch.int64)
    h = torch.empty(num_tokens, rank, dtype=torch.float32, device=x.device)
    block_r = triton.next_power_of_2(rank)
    _bgmv_shrink_kernel[(num_tokens,)](x, a, slots, h, in_features, x.stride(0), RANK=rank, BLOCK_R=block_r,
                                       BLOCK_K=shrink_block_k(block_r))
    block_n = expand_block_n(block_r)
    _bgmv_expand_kernel[(num_tokens, triton.cdiv(out_features, block_n))](
        h, b, slots, y, out_features, y.stride(0), RANK=rank, BLOCK_R=block_r, BLOCK_N=block_n)
    return y

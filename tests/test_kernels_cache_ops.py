"""Cache write, copy-on-write block copies and pool swaps: exact equality with the reference."""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before any @triton.jit is defined

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedcore.kernels.block_copy import copy_blocks, swap_blocks
from pagedcore.kernels.cache_write import reshape_and_cache
from pagedcore.kernels.reference import ref_copy_blocks, ref_reshape_and_cache, ref_swap_blocks

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SETTINGS = settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))


def _rand(shape, dtype, gen):
    return torch.randn(shape, generator=gen).to(dtype).to(DEVICE)


@SETTINGS
@given(
    num_tokens=st.integers(1, 40),
    num_kv_heads=st.sampled_from([1, 2, 3]),
    head_dim=st.sampled_from([64, 80, 96, 128]),
    block_size=st.sampled_from([8, 16, 32]),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**31 - 1),
)
def test_reshape_and_cache_exact(num_tokens, num_kv_heads, head_dim, block_size, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = num_tokens // block_size + 3
    key = _rand((num_tokens, num_kv_heads, head_dim), dtype, gen)
    value = _rand((num_tokens, num_kv_heads, head_dim), dtype, gen)
    # Distinct random slots, about a quarter of the tokens padding (-1).
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[torch.rand(num_tokens, generator=gen) < 0.25] = -1
    slots = slots.to(DEVICE)
    k_cache = _rand((num_blocks, block_size, num_kv_heads, head_dim), dtype, gen)
    v_cache = _rand((num_blocks, block_size, num_kv_heads, head_dim), dtype, gen)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    reshape_and_cache(key, value, k_cache, v_cache, slots)
    ref_reshape_and_cache(key, value, k_ref, v_ref, slots)
    assert torch.equal(k_cache, k_ref)  # padding slots untouched, everything else written
    assert torch.equal(v_cache, v_ref)


def test_reshape_and_cache_strided_input():
    """key/value as views of a fused qkv projection output (non-contiguous token stride)."""
    gen = torch.Generator().manual_seed(0)
    qkv = _rand((7, (4 + 2 + 2) * 64), torch.float32, gen).view(7, 8, 64)
    key, value = qkv[:, 4:6], qkv[:, 6:8]
    k_cache = torch.zeros(4, 8, 2, 64, device=DEVICE)
    v_cache = torch.zeros(4, 8, 2, 64, device=DEVICE)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    slots = torch.tensor([3, 9, 17, -1, 30, 0, 25], device=DEVICE)
    reshape_and_cache(key, value, k_cache, v_cache, slots)
    ref_reshape_and_cache(key, value, k_ref, v_ref, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


@SETTINGS
@given(
    num_layers=st.integers(1, 3),
    num_pairs=st.integers(1, 5),
    block_size=st.sampled_from([8, 16, 32]),
    head_dim=st.sampled_from([64, 80]),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**31 - 1),
)
def test_copy_blocks_exact(num_layers, num_pairs, block_size, head_dim, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 2 * num_pairs + 3
    perm = torch.randperm(num_blocks, generator=gen)
    src, dst = perm[:num_pairs], perm[num_pairs : 2 * num_pairs]  # dst disjoint from src
    src[0] = src[-1]  # one block copied to two destinations (CoW fan-out)
    shape = (num_blocks, block_size, 2, head_dim)
    caches = [(_rand(shape, dtype, gen), _rand(shape, dtype, gen)) for _ in range(num_layers)]
    refs = [(k.clone(), v.clone()) for k, v in caches]
    copy_blocks(caches, src.to(DEVICE), dst.to(DEVICE))
    ref_copy_blocks(refs, src, dst)
    for (k, v), (kr, vr) in zip(caches, refs):
        assert torch.equal(k, kr) and torch.equal(v, vr)


def test_copy_blocks_empty_is_noop():
    k = torch.randn(4, 8, 1, 64, device=DEVICE)
    before = k.clone()
    copy_blocks([(k, k.clone())], torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long))
    assert torch.equal(k, before)


def test_swap_blocks_exact():
    gen = torch.Generator().manual_seed(1)
    src = _rand((6, 16, 2, 64), torch.bfloat16, gen)
    dst = torch.zeros(5, 16, 2, 64, dtype=torch.bfloat16)  # the other pool (CPU)
    dst_ref = dst.clone()
    mapping = torch.tensor([[0, 4], [5, 1], [2, 2]])
    swap_blocks(src, dst, mapping)
    ref_swap_blocks(src, dst_ref, mapping)
    assert torch.equal(dst, dst_ref)
    back = torch.zeros_like(src)
    swap_blocks(dst, back, mapping.flip(1))  # swap in again
    for s, _ in mapping.tolist():
        assert torch.equal(back[s].cpu(), src[s].cpu())

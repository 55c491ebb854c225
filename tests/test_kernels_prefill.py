"""Varlen paged prefill kernel vs the torch reference (Triton interpreter on CPU)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before any @triton.jit is defined

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedcore.kernels.prefill_attention import paged_prefill_attention
from pagedcore.kernels.reference import ref_paged_attention
from pagedcore.kernels.testing import draw_batch_spec, make_paged_batch, rel_err, tolerance

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _run_prefill(b, scale, window, softcap, **kw):
    md = b.metadata
    out = torch.full_like(b.query, float("nan"))  # poison: every element must be written
    paged_prefill_attention(
        b.query, b.k_cache, b.v_cache, md.block_table, md.seq_lens, md.query_start_loc, md.max_query_len,
        scale, window, softcap, out=out, **kw,
    )
    return out


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_prefill_matches_reference(data):
    mode = data.draw(st.sampled_from(["prefill", "mixed"]), label="mode")
    query_lens, seq_lens = draw_batch_spec(data.draw, mode, max_seqs=3, max_decode_len=100, max_prompt=70)
    num_kv_heads = data.draw(st.integers(1, 2), label="num_kv_heads")
    group = data.draw(st.sampled_from([1, 3, 4]), label="gqa_group")
    head_dim = data.draw(st.sampled_from([64, 80, 96, 128]), label="head_dim")
    block_size = data.draw(st.sampled_from([8, 16, 32]), label="block_size")
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    window = data.draw(st.one_of(st.none(), st.integers(1, 100)), label="sliding_window")
    softcap = data.draw(st.one_of(st.none(), st.floats(1.0, 30.0)), label="softcap")
    peaky = data.draw(st.sampled_from([1.0, 6.0]), label="query_scale")  # sharp softmax: partition maxima differ
    seed = data.draw(st.integers(0, 2**31 - 1), label="seed")

    b = make_paged_batch(query_lens, seq_lens, num_kv_heads * group, num_kv_heads, head_dim, block_size, dtype, DEVICE, seed)
    b.query *= peaky
    b.write_new_tokens()
    scale = head_dim**-0.5
    out = _run_prefill(b, scale, window, softcap)
    ref = ref_paged_attention(b.query, b.k_cache, b.v_cache, b.metadata, scale, window, softcap)
    assert not out.isnan().any()
    assert out.dtype == dtype
    assert rel_err(out, ref) < tolerance(dtype)


def test_prefill_chunk_with_long_prefix_and_small_tiles():
    """A chunk whose prefix spans many tiles; small BLOCK_M/BLOCK_N so many programs and tiles run."""
    b = make_paged_batch([30, 1, 45], [200, 77, 45], 6, 2, 64, 16, torch.float32, DEVICE, seed=11)
    b.write_new_tokens()
    for window in (None, 50):
        out = _run_prefill(b, 0.125, window, None, block_m=16, block_n=16)
        ref = ref_paged_attention(b.query, b.k_cache, b.v_cache, b.metadata, 0.125, window)
        assert not out.isnan().any()
        assert rel_err(out, ref) < 1e-4


def test_prefill_large_gqa_group_one_token_per_program():
    """Group of 16 heads with block_m=16: BLOCK_Q == 1 query token per program."""
    b = make_paged_batch([5, 9], [20, 9], 16, 1, 64, 8, torch.float32, DEVICE, seed=5)
    b.write_new_tokens()
    out = _run_prefill(b, 0.125, None, 10.0, block_m=16)
    ref = ref_paged_attention(b.query, b.k_cache, b.v_cache, b.metadata, 0.125, None, 10.0)
    assert not out.isnan().any()
    assert rel_err(out, ref) < 1e-4

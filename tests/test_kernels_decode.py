"""Split-K paged decode kernel vs the torch reference (Triton interpreter on CPU)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before any @triton.jit is defined

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedcore.kernels.decode_attention import paged_decode_attention
from pagedcore.kernels.decode_plan import DecodePlan, plan_decode
from pagedcore.kernels.reference import ref_paged_attention
from pagedcore.kernels.testing import draw_batch_spec, make_paged_batch, rel_err, tolerance

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy exp overflow in the interpreter (tanh saturation)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _run_decode(b, scale, window, softcap, num_splits):
    md = b.metadata
    out = torch.full_like(b.query, float("nan"))  # poison: every element must be written
    paged_decode_attention(
        b.query, b.k_cache, b.v_cache, md.block_table, md.seq_lens, scale, window, softcap,
        query_start_loc=md.query_start_loc, max_seq_len=md.max_seq_len, out=out, num_splits=num_splits,
    )
    return out


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_decode_matches_reference(data):
    query_lens, seq_lens = draw_batch_spec(data.draw, "decode")
    num_kv_heads = data.draw(st.integers(1, 2), label="num_kv_heads")
    group = data.draw(st.sampled_from([1, 3, 4]), label="gqa_group")
    head_dim = data.draw(st.sampled_from([64, 80, 96, 128]), label="head_dim")
    block_size = data.draw(st.sampled_from([8, 16, 32]), label="block_size")
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    window = data.draw(st.one_of(st.none(), st.integers(1, 200)), label="sliding_window")
    softcap = data.draw(st.one_of(st.none(), st.floats(1.0, 30.0)), label="softcap")
    num_splits = data.draw(st.sampled_from([None, 1, 2, 3, 8]), label="num_splits")
    peaky = data.draw(st.sampled_from([1.0, 6.0]), label="query_scale")  # sharp softmax: partition maxima differ
    seed = data.draw(st.integers(0, 2**31 - 1), label="seed")

    b = make_paged_batch(query_lens, seq_lens, num_kv_heads * group, num_kv_heads, head_dim, block_size, dtype, DEVICE, seed)
    b.query *= peaky
    b.write_new_tokens()
    scale = head_dim**-0.5
    out = _run_decode(b, scale, window, softcap, num_splits)
    ref = ref_paged_attention(b.query, b.k_cache, b.v_cache, b.metadata, scale, window, softcap)
    assert not out.isnan().any()
    assert out.dtype == dtype
    assert rel_err(out, ref) < tolerance(dtype)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_long_context_mqa(num_splits):
    """MQA (8 query heads on 1 KV head), contexts of several partitions, very different lengths."""
    b = make_paged_batch([1, 1, 1], [700, 3, 257], 8, 1, 64, 16, torch.float32, DEVICE, seed=7)
    b.write_new_tokens()
    out = _run_decode(b, 0.125, None, None, num_splits)
    ref = ref_paged_attention(b.query, b.k_cache, b.v_cache, b.metadata, 0.125)
    assert not out.isnan().any()
    assert rel_err(out, ref) < 1e-4


def test_decode_only_selected_sequences_written():
    """seq_indices: rows of other sequences are left untouched (mixed batches rely on it)."""
    b = make_paged_batch([1, 1, 1], [20, 40, 60], 4, 2, 64, 8, torch.float32, DEVICE, seed=3)
    b.write_new_tokens()
    md = b.metadata
    out = torch.full_like(b.query, float("nan"))
    idx = torch.tensor([0, 2], dtype=torch.int32, device=DEVICE)
    paged_decode_attention(b.query, b.k_cache, b.v_cache, md.block_table, md.seq_lens, 0.1,
                           query_start_loc=md.query_start_loc, seq_indices=idx, out=out, num_splits=2)
    ref = ref_paged_attention(b.query, b.k_cache, b.v_cache, md, 0.1)
    assert out[1].isnan().all()
    assert rel_err(out[[0, 2]], ref[[0, 2]]) < 1e-4


def test_plan_decode():
    # Plenty of sequences x heads: no split (no reduction pass).
    assert plan_decode(256, 8, 4096, target_programs=528).num_splits == 1
    # One long sequence: split, partitions cover the context, >= 256 tokens each.
    p = plan_decode(1, 8, 8192, target_programs=528)
    assert p.num_splits > 1 and p.num_splits * p.partition_size >= 8192 and p.partition_size >= 256
    # Short context: never split below the minimum partition.
    assert plan_decode(1, 1, 300, target_programs=528).num_splits == 1
    # Forced split count is honoured up to rounding to whole tiles.
    p = plan_decode(1, 1, 1000, num_splits=4)
    assert p == DecodePlan(num_splits=4, partition_size=256)

"""Vectorised CPU paged attention vs the torch reference."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedcore.kernels.cpu_attention import cpu_paged_attention
from pagedcore.kernels.reference import ref_paged_attention
from pagedcore.kernels.testing import draw_batch_spec, make_paged_batch, rel_err

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_cpu_attention_matches_reference(data):
    mode = data.draw(st.sampled_from(["decode", "prefill", "mixed"]), label="mode")
    query_lens, seq_lens = draw_batch_spec(data.draw, mode, max_seqs=6)
    num_kv_heads = data.draw(st.integers(1, 2), label="num_kv_heads")
    group = data.draw(st.sampled_from([1, 3, 4]), label="gqa_group")
    head_dim = data.draw(st.sampled_from([64, 80, 96, 128]), label="head_dim")
    block_size = data.draw(st.sampled_from([8, 16, 32]), label="block_size")
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    window = data.draw(st.one_of(st.none(), st.integers(1, 200)), label="sliding_window")
    softcap = data.draw(st.one_of(st.none(), st.floats(1.0, 30.0)), label="softcap")
    padding = data.draw(st.integers(0, 2), label="padding_tokens")
    seed = data.draw(st.integers(0, 2**31 - 1), label="seed")

    b = make_paged_batch(query_lens, seq_lens, num_kv_heads * group, num_kv_heads, head_dim, block_size, dtype,
                         "cpu", seed, num_padding_tokens=padding)
    b.write_new_tokens()  # unused slots stay NaN: the CPU path must never let them leak
    scale = head_dim**-0.5
    out = cpu_paged_attention(b.query, b.k_cache, b.v_cache, b.metadata, scale, window, softcap)
    ref = ref_paged_attention(b.query, b.k_cache, b.v_cache, b.metadata, scale, window, softcap)
    assert not out.isnan().any()
    assert out.dtype == dtype and out.shape == b.query.shape
    assert rel_err(out, ref) < (2e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_attention_decode_lengths_bucketed(dtype):
    """Very different decode lengths (several length buckets) plus a prefix-hit chunk."""
    ql = [1] * 7 + [12]
    sl = [1, 2, 9, 16, 17, 150, 600, 60]
    b = make_paged_batch(ql, sl, 9, 3, 64, 16, dtype, "cpu", seed=2)
    b.write_new_tokens()
    out = cpu_paged_attention(b.query, b.k_cache, b.v_cache, b.metadata, 0.125)
    ref = ref_paged_attention(b.query, b.k_cache, b.v_cache, b.metadata, 0.125)
    assert not out.isnan().any()
    assert rel_err(out, ref) < (2e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window,softcap", [(None, None), (40, None), (None, 20.0)])
def test_cpu_decode_kernel_matches_torch_path_and_reference(dtype, window, softcap):
    """The C++ decode kernel (built on first use) against the pure-torch path and the reference,
    on a mixed batch with NaN in every unwritten slot and non-contiguous query rows."""
    from pagedcore.kernels import cpu_ext

    if cpu_ext.load() is None:
        pytest.skip("no C++ toolchain: the torch path is what runs")
    ql = [1, 1, 5, 1, 1, 1]
    sl = [1, 17, 40, 100, 257, 33]
    b = make_paged_batch(ql, sl, 12, 3, 64, 16, dtype, "cpu", seed=7, num_padding_tokens=2)
    b.write_new_tokens()
    query = b.query.transpose(0, 1).contiguous().transpose(0, 1)  # [T, Hq, D] as transformers hands it over
    ext = cpu_paged_attention(query, b.k_cache, b.v_cache, b.metadata, 0.125, window, softcap)
    torch_path = cpu_paged_attention(query, b.k_cache, b.v_cache, b.metadata, 0.125, window, softcap, use_ext=False)
    ref = ref_paged_attention(b.query, b.k_cache, b.v_cache, b.metadata, 0.125, window, softcap)
    assert not ext.isnan().any()
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    assert rel_err(ext, ref) < tol and rel_err(ext, torch_path) < tol

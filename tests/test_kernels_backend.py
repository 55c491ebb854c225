"""TritonAttentionBackend end to end: cache write + attention == reference, on mixed batches."""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before any @triton.jit is defined

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedcore.attention.backend import AttentionBackend
from pagedcore.kernels import triton_attention_backend
from pagedcore.kernels.reference import ref_copy_blocks, ref_paged_attention, ref_reshape_and_cache
from pagedcore.kernels.testing import draw_batch_spec, make_paged_batch, rel_err, tolerance
from pagedcore.kernels.triton_attention_backend import TritonAttentionBackend, TritonAttentionMetadata

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _poison_backend_output(monkeypatch):
    """The backend's output buffer starts as NaN: every row must be written (or zeroed if padding)."""
    monkeypatch.setattr(triton_attention_backend, "_new_output", lambda q: torch.full_like(q, float("nan")))


def _check_forward(b, backend, scale, window=None, softcap=None, dtype=torch.float32, layers=2):
    md = backend.build_metadata(b.metadata)
    # Reference: write with the reference writer into a copy of the cache, then attend.
    k_ref, v_ref = b.k_cache.clone(), b.v_cache.clone()
    ref_reshape_and_cache(b.key, b.value, k_ref, v_ref, b.metadata.slot_mapping)
    ref = ref_paged_attention(b.query, k_ref, v_ref, b.metadata, scale, window, softcap)
    for _ in range(layers):  # the per-step metadata (plan, workspace) is reused across layers
        out = backend.forward(b.query, b.key, b.value, b.k_cache, b.v_cache, md, scale, window, softcap)
        assert not out.isnan().any()
        assert rel_err(out, ref) < tolerance(dtype)
    # The backend wrote exactly this step's tokens (NaN poison elsewhere compares equal).
    assert torch.equal(b.k_cache.nan_to_num(123.0), k_ref.nan_to_num(123.0))
    assert torch.equal(b.v_cache.nan_to_num(123.0), v_ref.nan_to_num(123.0))
    return md


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backend_mixed_batch(dtype):
    # decode rows, a fresh prompt, a chunk after a cached prefix, padding tokens at the end.
    b = make_paged_batch([1, 23, 1, 9, 1], [40, 23, 130, 50, 1], 12, 4, 64, 16, dtype, DEVICE, seed=4,
                         num_padding_tokens=3)
    md = _check_forward(b, TritonAttentionBackend(), 0.125, dtype=dtype)
    assert md.num_decodes == 3 and md.num_prefills == 2 and not md.is_pure_decode


@pytest.mark.parametrize("window,softcap", [(None, None), (30, None), (None, 20.0)])
def test_backend_pure_decode_split_k(window, softcap):
    b = make_paged_batch([1, 1], [700, 45], 9, 3, 80, 8, torch.float32, DEVICE, seed=9)
    b.query *= 4.0  # sharp softmax: partition maxima differ, so a wrong rescale shows
    backend = TritonAttentionBackend(target_programs=64)  # force split-K even on 2 CPU cores
    md = _check_forward(b, backend, 80**-0.5, window, softcap)
    assert md.is_pure_decode
    assert md.decode_plan(3, window).num_splits == (1 if window else 2)


def test_backend_accepts_common_metadata_and_copy_blocks():
    b = make_paged_batch([3, 1], [3, 20], 4, 4, 96, 32, torch.float16, DEVICE, seed=1, poison=False)
    backend = TritonAttentionBackend()
    assert isinstance(backend, AttentionBackend) and backend.name == "triton"
    out = backend.forward(b.query, b.key, b.value, b.k_cache, b.v_cache, b.metadata, 0.1)
    ref = ref_paged_attention(b.query, b.k_cache, b.v_cache, b.metadata, 0.1)
    assert rel_err(out, ref) < 2e-2
    assert isinstance(backend.build_metadata(b.metadata), TritonAttentionMetadata)

    caches = [(b.k_cache.clone(), b.v_cache.clone()) for _ in range(2)]
    refs = [(k.clone(), v.clone()) for k, v in caches]
    src, dst = torch.tensor([1, 2]), torch.tensor([0, 3])
    backend.copy_blocks(caches, src.to(DEVICE), dst.to(DEVICE))
    ref_copy_blocks(refs, src, dst)
    for (k, v), (kr, vr) in zip(caches, refs):
        assert torch.equal(k, kr) and torch.equal(v, vr)


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_backend_forward_matches_reference(data):
    mode = data.draw(st.sampled_from(["decode", "prefill", "mixed"]), label="mode")
    query_lens, seq_lens = draw_batch_spec(data.draw, mode, max_seqs=4, max_decode_len=200, max_prompt=40)
    num_kv_heads = data.draw(st.integers(1, 2), label="num_kv_heads")
    group = data.draw(st.sampled_from([1, 3, 4]), label="gqa_group")
    head_dim = data.draw(st.sampled_from([64, 80, 96, 128]), label="head_dim")
    block_size = data.draw(st.sampled_from([8, 16, 32]), label="block_size")
    dtype = data.draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]), label="dtype")
    window = data.draw(st.one_of(st.none(), st.integers(1, 100)), label="sliding_window")
    softcap = data.draw(st.one_of(st.none(), st.floats(1.0, 30.0)), label="softcap")
    target = data.draw(st.sampled_from([None, 64]), label="target_programs")
    padding = data.draw(st.integers(0, 2), label="padding_tokens")
    seed = data.draw(st.integers(0, 2**31 - 1), label="seed")
    b = make_paged_batch(query_lens, seq_lens, num_kv_heads * group, num_kv_heads, head_dim, block_size, dtype,
                         DEVICE, seed, num_padding_tokens=padding)
    _check_forward(b, TritonAttentionBackend(target_programs=target), head_dim**-0.5, window, softcap, dtype, layers=1)

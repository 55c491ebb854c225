"""Quantized KV cache (EngineConfig.kv_cache_dtype "int8" / "fp8_e4m3", kernels/kv_quant.py).

Kernels: every cache writer (torch reference, C++, Triton in its interpreter) stores what
`kv_quant.quantize` stores, and every attention path (C++ decode, the torch CPU paths, Triton decode
and prefill) equals the fp32 reference attention over the *de-quantized* cache; the settings refuse
what cannot run. The engine end to end on the bundled model: tests/test_kv_cache_quant_engine.py.
"""

from __future__ import annotations

import pytest
import torch

from pagedcore import LLM
from pagedcore.config import EngineConfig
from pagedcore.kernels import kv_quant
from pagedcore.kernels.reference import ref_paged_attention
from pagedcore.kernels.testing import make_paged_batch, rel_err

QUANT = ["int8", "fp8_e4m3"]


def quantized_caches(batch, kv_cache_dtype: str):
    """The batch's caches as quantized caches: its prefix written through the reference quantizer, every
    other slot poisoned (0xff bytes: NaN scales, and NaN e4m3 values)."""
    nb, bs, hkv, d = batch.k_cache.shape
    layout = kv_quant.KVCacheLayout(kv_cache_dtype, bs, hkv, d)
    caches = []
    for plain in (batch.k_cache, batch.v_cache):
        cache = kv_quant.allocate(layout, nb, "cpu")
        cache.fill_(0xFF)
        flat = plain.reshape(-1, hkv, d)
        written = ~flat.isnan().any(-1).any(-1)
        slots = written.nonzero().squeeze(1)
        data, scales = kv_quant.split(cache)
        q, s = kv_quant.quantize(flat[slots], kv_cache_dtype)
        data[slots // bs, slots % bs] = q
        scales[slots // bs, slots % bs] = s
        caches.append(cache)
    return caches


def reference_over_dequantized(batch, k_cache, v_cache, scale):
    """fp32 attention over what the (already written) quantized caches hold."""
    k = kv_quant.dequantize_cache(k_cache)
    v = kv_quant.dequantize_cache(v_cache)
    return ref_paged_attention(batch.query.float(), k, v, batch.metadata, scale).to(batch.query.dtype)


# ---------------------------------------------------------------- format


@pytest.mark.parametrize("kv_cache_dtype", QUANT)
def test_per_token_scales_bound_the_error_of_every_row_whatever_came_before(kv_cache_dtype):
    # Rows of growing magnitude, as tokens arriving in one block: each keeps its own error bound.
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 3, 64, generator=g) * torch.logspace(-3, 3, 16)[:, None, None]
    q, s = kv_quant.quantize(x, kv_cache_dtype)
    assert q.dtype == kv_quant.data_dtype(kv_cache_dtype) and s.dtype == torch.float16
    err = (kv_quant.dequantize(q, s) - x).abs()
    amax = x.abs().amax(-1, keepdim=True)
    if kv_cache_dtype == "int8":
        assert (err <= s.float()[..., None] * 0.5 + amax * 1e-3).all()  # half a step (+ the scale's fp16 rounding)
    else:  # e4m3: 3 mantissa bits, relative 2^-4 at worst for normals; subnormals below 2^-6 of qmax
        assert (err <= x.abs() * 2 ** -4 + amax * 2 ** -9 + 1e-12).all()
    assert (kv_quant.quantize(torch.zeros(2, 8), kv_cache_dtype)[0].float() == 0).all()  # zero rows: zero, no NaN


def test_a_quantized_block_is_about_half_a_bf16_block():
    layout = kv_quant.KVCacheLayout("int8", 16, 3, 64)
    bf16_block = 16 * 3 * 64 * 2
    assert layout.block_bytes == 16 * 3 * (64 + 2)  # values + fp16 scales
    assert bf16_block / layout.block_bytes >= 1.9


# ---------------------------------------------------------------- cache writers


def _written_batch(kv_cache_dtype, dtype=torch.float32, seed=0):
    batch = make_paged_batch([1, 5, 3], [9, 5, 20], 6, 2, 64, 8, dtype=dtype, seed=seed, num_padding_tokens=2)
    return batch, quantized_caches(batch, kv_cache_dtype)


def _assert_same_quantized(got, want, kv_cache_dtype):
    """Same scales (to fp16 rounding) and values within one step of the reference (division order may
    flip a rounding); nearly all identical."""
    (gd, gs), (wd, ws) = kv_quant.split(got), kv_quant.split(want)
    written = ~ws.isnan()
    torch.testing.assert_close(gs[written], ws[written], rtol=1e-3, atol=0)
    deq_g = kv_quant.dequantize(gd, gs)[written]
    deq_w = kv_quant.dequantize(wd, ws)[written]
    step = ws[written].float()[:, None] * (1.0 if kv_cache_dtype == "int8" else 32.0)
    assert ((deq_g - deq_w).abs() <= step * 1.001).all()
    assert (gd.view(torch.uint8)[written] == wd.view(torch.uint8)[written]).float().mean() > 0.99


@pytest.mark.parametrize("kv_cache_dtype", QUANT)
def test_cpp_quantizing_write_matches_the_reference(kv_cache_dtype, ext):
    batch, (k_ref, v_ref) = _written_batch(kv_cache_dtype)
    _, (k, v) = _written_batch(kv_cache_dtype)
    kv_quant.write(batch.key, batch.value, k_ref, v_ref, batch.metadata.slot_mapping)
    (kd, ks), (vd, vs) = kv_quant.split(k), kv_quant.split(v)
    ext.write_kv_cache_quant(batch.key, batch.value, kd, vd, ks, vs, batch.metadata.slot_mapping)
    _assert_same_quantized(k, k_ref, kv_cache_dtype)
    _assert_same_quantized(v, v_ref, kv_cache_dtype)


@pytest.mark.parametrize("kv_cache_dtype", QUANT)
def test_triton_quantizing_write_matches_the_reference(kv_cache_dtype):
    pytest.importorskip("triton")
    from pagedcore.kernels.cache_write import reshape_and_cache

    batch, (k_ref, v_ref) = _written_batch(kv_cache_dtype, dtype=torch.bfloat16)
    _, (k, v) = _written_batch(kv_cache_dtype, dtype=torch.bfloat16)
    kv_quant.write(batch.key, batch.value, k_ref, v_ref, batch.metadata.slot_mapping)
    (kd, ks), (vd, vs) = kv_quant.split(k), kv_quant.split(v)
    reshape_and_cache(batch.key, batch.value, kd, vd, batch.metadata.slot_mapping, k_scales=ks, v_scales=vs)
    _assert_same_quantized(k, k_ref, kv_cache_dtype)
    _assert_same_quantized(v, v_ref, kv_cache_dtype)


# ---------------------------------------------------------------- attention over a quantized cache

# (query_lens, seq_lens): decode rows across block boundaries, prompts, and chunks with a cached prefix
MIXED = ([1, 1, 7, 4, 1], [1, 70, 7, 30, 33])


def _torch_backend_forward(batch, k, v, scale, use_ext):
    from pagedcore.attention import torch_backend
    from pagedcore.kernels import cpu_attention, cpu_ext

    torch_backend.write_kv_cache(batch.key, batch.value, k, v, batch.metadata.slot_mapping)
    if use_ext and cpu_ext.load() is None:
        pytest.skip("no C++ toolchain")
    return cpu_attention.cpu_paged_attention(batch.query, k, v, batch.metadata, scale, use_ext=use_ext)


@pytest.mark.parametrize("use_ext", [True, False], ids=["cpp", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kv_cache_dtype", QUANT)
def test_cpu_attention_equals_the_reference_over_the_dequantized_cache(kv_cache_dtype, dtype, use_ext):
    for head_dim, seed in ((64, 0), (40, 1)):  # 40: the C++ kernel's scalar path
        batch = make_paged_batch(*MIXED, 6, 2, head_dim, 16, dtype=dtype, seed=seed)
        k, v = quantized_caches(batch, kv_cache_dtype)
        scale = head_dim ** -0.5
        out = _torch_backend_forward(batch, k, v, scale, use_ext)
        want = reference_over_dequantized(batch, k, v, scale)
        assert not out.isnan().any()
        assert rel_err(out, want) < (1e-4 if dtype == torch.float32 else 2e-2), (head_dim, rel_err(out, want))
        # and close to attention over the unquantized cache: the quantization error only
        batch.write_new_tokens()
        exact = ref_paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.metadata, scale)
        assert rel_err(out, exact) < (0.03 if kv_cache_dtype == "int8" else 0.15)


@pytest.mark.parametrize("kv_cache_dtype", QUANT)
def test_cpp_decode_splits_long_sequences_over_threads_with_quantized_cache(kv_cache_dtype, ext):
    # One long sequence among short ones is cut into partitions (flash-decoding) with several threads.
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        batch = make_paged_batch([1, 1, 1], [1500, 3, 40], 9, 3, 64, 16, seed=5)
        k, v = quantized_caches(batch, kv_cache_dtype)
        out = _torch_backend_forward(batch, k, v, 0.125, use_ext=True)
    finally:
        torch.set_num_threads(threads)
    assert rel_err(out, reference_over_dequantized(batch, k, v, 0.125)) < 1e-4


@pytest.mark.parametrize("kv_cache_dtype", QUANT)
def test_cpp_decode_of_one_sequence_splits_its_kv_heads_with_quantized_cache(kv_cache_dtype, ext):
    # One sequence, two threads: its KV heads in two items, each scaling its own heads' scores and weights.
    batch = make_paged_batch([1], [90], 9, 3, 64, 16, seed=6)
    k, v = quantized_caches(batch, kv_cache_dtype)
    threads = torch.get_num_threads()
    try:
        out = {}
        for n in (1, 2):
            torch.set_num_threads(n)
            out[n] = _torch_backend_forward(batch, k, v, 0.125, use_ext=True)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(out[2], out[1])
    assert rel_err(out[2], reference_over_dequantized(batch, k, v, 0.125)) < 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kv_cache_dtype", QUANT)
def test_triton_backend_equals_the_reference_over_the_dequantized_cache(kv_cache_dtype, dtype):
    pytest.importorskip("triton")
    from pagedcore.kernels.triton_attention_backend import TritonAttentionBackend

    batch = make_paged_batch(*MIXED, 6, 2, 64, 16, dtype=dtype, seed=2, num_padding_tokens=1)
    k, v = quantized_caches(batch, kv_cache_dtype)
    backend = TritonAttentionBackend(target_programs=64)  # split-K decode: several partitions
    out = backend.forward(batch.query, batch.key, batch.value, k, v, batch.metadata, scale=0.125)
    want = reference_over_dequantized(batch, k, v, 0.125)
    n = batch.metadata.query_start_loc_cpu[-1]
    assert not out[:n].isnan().any()
    assert rel_err(out[:n], want[:n]) < (1e-4 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("kv_cache_dtype", QUANT)
def test_triton_decode_split_k_over_quantized_cache(kv_cache_dtype):
    pytest.importorskip("triton")
    from pagedcore.kernels.decode_attention import paged_decode_attention

    batch = make_paged_batch([1, 1], [300, 77], 6, 2, 64, 16, seed=3)
    k, v = quantized_caches(batch, kv_cache_dtype)
    kv_quant.write(batch.key, batch.value, k, v, batch.metadata.slot_mapping)
    (kd, ks), (vd, vs) = kv_quant.split(k), kv_quant.split(v)
    md = batch.metadata
    out = paged_decode_attention(batch.query, kd, vd, md.block_table, md.seq_lens, 0.125, num_splits=4,
                                 k_scales=ks, v_scales=vs)
    assert rel_err(out, reference_over_dequantized(batch, k, v, 0.125)) < 1e-4


# ---------------------------------------------------------------- blocks carry their scales


@pytest.mark.parametrize("copier", ["default", "triton"])
def test_block_copies_and_swaps_carry_the_scales(copier):
    from pagedcore.attention.backend import AttentionBackend

    batch = make_paged_batch([1], [40], 2, 2, 64, 16, seed=4)
    k, v = quantized_caches(batch, "int8")
    src = batch.metadata.block_table[0, :3].long()
    dst = torch.tensor([b for b in range(k.shape[0]) if b not in src.tolist()][:3])
    if copier == "triton":
        pytest.importorskip("triton")
        from pagedcore.kernels.block_copy import copy_blocks
        copy_blocks([(k, v)], src, dst)
    else:
        AttentionBackend.copy_blocks(None, [(k, v)], src, dst)
    for cache in (k, v):
        data, scales = kv_quant.split(cache)
        assert torch.equal(data[dst].view(torch.uint8), data[src].view(torch.uint8))
        assert torch.equal(scales[dst].view(torch.int16), scales[src].view(torch.int16))
    # swap out to a CPU pool and back (ModelRunner.swap: whole rows of the uint8 caches)
    layout = kv_quant.layout_of(k)
    cpu = kv_quant.allocate(layout, 4, "cpu")
    cpu[torch.tensor([0, 1, 2])] = k[src]
    back = kv_quant.allocate(layout, k.shape[0], "cpu")
    back[dst] = cpu[torch.tensor([0, 1, 2])]
    (bd, bsc), (kd, ksc) = kv_quant.split(back), kv_quant.split(k)
    assert torch.equal(bd[dst].view(torch.uint8), kd[src].view(torch.uint8))
    assert torch.equal(bsc[dst].view(torch.int16), ksc[src].view(torch.int16))  # bits: poisoned slots are NaN


# ---------------------------------------------------------------- settings and bad input


def test_kv_cache_dtype_is_an_engine_setting_of_every_front_door():
    import argparse

    from pagedcore import settings

    p = argparse.ArgumentParser()
    settings.add_engine_arguments(p)
    assert settings.settings_from_args(p.parse_args(["--kv-cache-dtype", "int8"])) == {"kv_cache_dtype": "int8"}
    assert settings.settings_from_env({"PAGEDCORE_KV_CACHE_DTYPE": "fp8_e4m3"}) == {"kv_cache_dtype": "fp8_e4m3"}
    assert EngineConfig(**settings.settings_from_args(p.parse_args(["--kv-cache-dtype", "int8"]))).kv_cache_dtype == "int8"
    assert "int8" in settings.field_help()["kv_cache_dtype"]


def test_unknown_kv_cache_dtype_is_refused_naming_the_supported_ones():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, int8, fp8_e4m3, got 'int4'"):
        EngineConfig(kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="auto, int8, fp8_e4m3"):
        kv_quant.check_kv_cache_dtype("fp16")


def test_a_backend_that_cannot_read_a_quantized_cache_is_refused(smollm2_dir):
    from pagedcore.attention.torch_backend import TorchAttentionBackend
    from pagedcore.hookspecs import hookimpl

    class PlainOnly(TorchAttentionBackend):
        name = "plain-only"
        kv_cache_dtypes = ("auto",)

    class Plugin:
        @hookimpl
        def pagedcore_attention_backend(self, name, device):
            return PlainOnly() if name == "plain-only" else None

    with pytest.raises(ValueError, match="'plain-only' supports kv_cache_dtype auto; got 'int8'"):
        LLM(str(smollm2_dir), dtype="float32", num_kv_blocks=8, kv_cache_dtype="int8", attention_backend="plain-only",
            plugins=[Plugin()])


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() >= (8, 9),
                    reason="needs a GPU without e4m3 conversions (compute capability < 8.9)")
def test_fp8_on_a_gpu_without_e4m3_is_refused_naming_the_supported_ones():
    with pytest.raises(ValueError, match="supported here: auto, int8"):
        kv_quant.check_kv_cache_dtype("fp8_e4m3", torch.device("cuda"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kv_cache_dtype", QUANT)
def test_cpp_prefill_kernel_reads_quantized_caches(kv_cache_dtype, dtype, monkeypatch):
    """Prompts (whole, and chunks after a cached context) over int8 / fp8 caches through the C++ prefill kernel,
    never SDPA, against attention over what the caches hold; poisoned (NaN) unwritten slots never reach it."""
    from pagedcore.kernels import cpu_attention, cpu_ext

    ext = cpu_ext.load()
    if ext is None or not ext.paged_prefill_supported(64):
        pytest.skip("the C++ prefill kernel runs on AVX-512 CPUs only")

    def fail(*a, **k):
        raise AssertionError("SDPA ran: the kernel should have taken every prompt")

    monkeypatch.setattr(cpu_attention.F, "scaled_dot_product_attention", fail)
    batch = make_paged_batch([2, 31, 64, 1, 100], [2, 40, 64, 20, 230], 9, 3, 64, 16, dtype=dtype, seed=4)
    k, v = quantized_caches(batch, kv_cache_dtype)
    out = _torch_backend_forward(batch, k, v, 0.125, use_ext=True)
    want = reference_over_dequantized(batch, k, v, 0.125)
    assert not out.isnan().any()
    assert rel_err(out, want) < (1e-5 if dtype == torch.float32 else 2e-2)

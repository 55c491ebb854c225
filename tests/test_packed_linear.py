"""Linears over pre-packed weights (kernels/csrc/cpu_gemm.cpp, pagedcore/packed_linear.py) against torch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedcore import LLM, SamplingParams, installs, packed_linear, vnni_layout

# Row counts cover every micro-kernel tile height (1-6), a cache block boundary (96) and more.
ROWS = [1, 2, 3, 4, 5, 6, 7, 13, 97, 200]
# Output widths that are and are not a multiple of the 16-column panel; 1-4 panels side by side (AVX-512 tiles).
SHAPES = [(48, 32), (37, 64), (200, 576), (16, 1), (160, 40)]


def _reference(x, w, b):
    y = x.double() @ w.double().T
    return y if b is None else y + b.double()


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_fp32_matches_float64_reference(ext, m, n, k, bias):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    w, x = torch.randn(n, k, generator=g), torch.randn(m, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    y = ext.packed_linear(x, ext.pack_linear_weight(w), n, b)
    assert y.shape == (m, n) and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), _reference(x, w, b), rtol=1e-5, atol=1e-4 * k ** 0.5)
    torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-4 * k ** 0.5)


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("n,k", SHAPES)
def test_bf16_is_fp32_math_rounded_once(ext, m, n, k):
    """bf16 in, bf16 out: the exact product of the bf16 values, summed in fp32, rounded once."""
    g = torch.Generator().manual_seed(m + 7 * n + k)
    w = torch.randn(n, k, generator=g).bfloat16()
    x = torch.randn(m, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16()
    y = ext.packed_linear(x, ext.pack_linear_weight(w), n, b)
    assert y.dtype == torch.bfloat16
    ref = _reference(x, w, b)
    # One bf16 rounding (rel 2^-8) of the result; fp32 summation error is far below it.
    torch.testing.assert_close(y.double(), ref, rtol=2 ** -8, atol=1e-3 * k ** 0.5)
    assert (y.double() == ref.bfloat16().double()).float().mean() > 0.9


def test_leading_dims_and_non_contiguous_input(ext):
    w = torch.randn(40, 24)
    x = torch.randn(3, 24, 5).transpose(1, 2)  # [3, 5, 24], not contiguous
    y = ext.packed_linear(x, ext.pack_linear_weight(w), 40)
    assert y.shape == (3, 5, 40)
    torch.testing.assert_close(y, F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_nan_and_inf_propagate(ext):
    w = torch.randn(32, 16)
    x = torch.randn(4, 16)
    x[1, 3] = float("nan")
    x[2, 0] = float("inf")
    for dtype in (torch.float32, torch.bfloat16):
        y = ext.packed_linear(x.to(dtype), ext.pack_linear_weight(w.to(dtype)), 32).float()
        ref = F.linear(x.double(), w.double()).float()
        assert torch.isnan(y[1]).all()
        assert torch.equal(torch.isnan(y), torch.isnan(ref)) and torch.equal(torch.isinf(y), torch.isinf(ref))


def test_bad_shapes_raise(ext):
    packed = ext.pack_linear_weight(torch.randn(32, 16))
    with pytest.raises(RuntimeError, match="in_features"):
        ext.packed_linear(torch.randn(2, 17), packed, 32)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ext.pack_linear_weight(torch.randn(32, 16).half())


def test_install_patches_every_linear_and_restore_undoes_it(ext):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.GELU(), torch.nn.Linear(40, 8, bias=False))
    x = torch.randn(5, 24)
    before = model(x)
    assert packed_linear.install(model, torch.device("cpu")) == 2
    assert all(hasattr(m, "_pagedcore_packed") for m in model if isinstance(m, torch.nn.Linear))
    with torch.inference_mode():
        torch.testing.assert_close(model(x), before, rtol=1e-5, atol=1e-5)
    assert packed_linear.install(model, torch.device("cpu")) == 0  # idempotent
    assert packed_linear.restore(model) == 2
    assert not any(hasattr(m, "_pagedcore_packed") or "forward" in m.__dict__ for m in model)
    torch.testing.assert_close(model(x), before)


def test_training_input_keeps_torch_path(ext):
    """A tensor that needs gradients goes through F.linear (the kernel has no backward)."""
    lin = torch.nn.Linear(16, 16)
    packed_linear.install(lin, torch.device("cpu"))
    x = torch.randn(2, 16, requires_grad=True)
    lin(x).sum().backward()
    assert x.grad is not None


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_tokens_equal_with_and_without_packing(ext, tiny_model_dir, dtype):
    prompts = [[5 + i for i in range(n)] for n in (3, 20, 41)]
    params = SamplingParams(temperature=0, max_tokens=10, logprobs=2)
    runs = {}
    for pack in (True, False):
        llm = LLM(str(tiny_model_dir("qwen2")), dtype=dtype, num_kv_blocks=64, pack_weights=pack)
        linears = [m for m in llm.engine.model.modules() if isinstance(m, torch.nn.Linear)]
        assert all(hasattr(m, "_pagedcore_packed") == pack for m in linears)
        runs[pack] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    tol = 1e-4 if dtype == "float32" else 0.1
    for a, b in zip(runs[True], runs[False]):
        assert a.token_ids == b.token_ids
        for tok, sa, sb in zip(a.token_ids, a.logprobs, b.logprobs):
            assert abs(sa[tok].logprob - sb[tok].logprob) < tol


@pytest.fixture(scope="module")
def tied_model_dir(tmp_path_factory, smollm2_tokenizer):
    """A tiny Llama whose LM head is its input embedding (as the bundled SmolLM2's)."""
    from transformers import AutoModelForCausalLM

    from conftest import tiny_config

    config = tiny_config("llama")
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    d = tmp_path_factory.mktemp("tiny-tied")
    model.save_pretrained(d)
    smollm2_tokenizer.save_pretrained(d)
    return d


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_released_dense_weights_same_tokens_half_the_bytes(ext, tied_model_dir, dtype, monkeypatch):
    """An engine's own model keeps only the packed copies; the tied embedding reads the packed head. (oneDNN's
    second bf16 copy on AMX CPUs is off here: test_onednn_linear.py counts it.)"""
    from pagedcore import onednn_linear
    from pagedcore.bench import weights

    monkeypatch.setattr(onednn_linear, "ROWS", None)

    prompts = [[5 + i for i in range(n)] for n in (3, 20, 41)]
    params = SamplingParams(temperature=0, max_tokens=10, logprobs=2)
    runs, bytes_ = {}, {}
    for pack in (True, False):
        llm = LLM(str(tied_model_dir), dtype=dtype, num_kv_blocks=64, pack_weights=pack)
        model = llm.engine.model
        linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
        assert all((m.weight.numel() == 0) == pack for m in linears)
        assert ("forward" in vars(model.model.embed_tokens)) == pack
        runs[pack] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        bytes_[pack] = weights.weight_bytes("", model).total
    # One copy of every weight either way (packed or dense): the same bytes, up to panel padding.
    assert bytes_[True] == pytest.approx(bytes_[False], rel=0.01)
    tol = 1e-4 if dtype == "float32" else 0.1
    for a, b in zip(runs[True], runs[False]):
        assert a.token_ids == b.token_ids
        for tok, sa, sb in zip(a.token_ids, a.logprobs, b.logprobs):
            assert abs(sa[tok].logprob - sb[tok].logprob) < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_panel_lookup_equals_the_embedding(ext, dtype):
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.embed = torch.nn.Embedding(40, 24, dtype=dtype)  # 40 rows: the last panel half full
    model.head = torch.nn.Linear(24, 40, bias=False, dtype=dtype)
    model.head.weight = model.embed.weight
    ids = torch.tensor([[0, 15, 16, 39], [7, 7, 31, 32]])
    want = model.embed(ids)
    packed_linear.install(model, torch.device("cpu"))
    assert packed_linear.release_dense(model) == 1
    assert model.embed.weight.numel() == 0 and model.head.weight.numel() == 0
    with torch.inference_mode():
        torch.testing.assert_close(model.embed(ids), want, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match=f"keeps only its packed {dtype} CPU weight"):
        model.head(torch.randn(2, 24, dtype=torch.float64))


def test_panel_lookup_reads_the_greedy_heads_row_copy(ext):
    """Where the bf16 greedy head keeps a row copy of the pairs (or of the plain panels, on AVX2), a tied embedding
    looks its rows up there (the same values); once the head's weight is re-packed the copy is not that weight's any
    more and the panels serve."""
    from pagedcore.greedy_head import GreedyHead

    vnni = vnni_layout.enabled(ext)
    pairs_head = ext.greedy_head_bf16_supported() or ext.greedy_head_amx_supported()
    if not (pairs_head if vnni else ext.greedy_head_bf16_panels_supported()):
        pytest.skip("the bf16 greedy head runs on AVX512-BF16 or AMX CPUs, or AVX2 CPUs")
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.embed = torch.nn.Embedding(40, 64, dtype=torch.bfloat16)
    model.lm_head = torch.nn.Linear(64, 40, bias=False, dtype=torch.bfloat16)
    model.lm_head.weight = model.embed.weight
    ids = torch.tensor([[0, 15, 16, 39], [7, 7, 31, 32]])
    want = model.embed(ids)
    packed_linear.install(model, torch.device("cpu"))
    packed_linear.release_dense(model)
    head = GreedyHead(ext, model.lm_head, 40, tied=True)  # (the AMX head keeps the rows for a tied embedding only)
    rows = model.lm_head._pagedcore_rows
    assert rows[0] is model.lm_head._pagedcore_packed and rows[1] is head.weight
    with torch.inference_mode():
        torch.testing.assert_close(model.embed(ids), want, rtol=0, atol=0)
        model.lm_head._pagedcore_rows = (rows[0], torch.zeros_like(rows[1]))  # read: the lookup returns zeros
        assert not model.embed(ids).any()
        model.lm_head._pagedcore_packed = rows[0].clone()  # re-packed: the copy is stale, the pairs serve
        torch.testing.assert_close(model.embed(ids), want, rtol=0, atol=0)
    assert packed_linear.restore(model) >= 1 and "_pagedcore_rows" not in vars(model.lm_head)


def test_a_lent_model_keeps_its_dense_weights(ext):
    model = torch.nn.Sequential(torch.nn.Linear(16, 32))
    installs.track(model)
    packed_linear.install(model, torch.device("cpu"))
    assert packed_linear.release_dense(model) == 0 and model[0].weight.numel() == 16 * 32


def test_threads_share_the_callers_input_buffer(ext):
    """Calls big enough to split panels between threads, after calls of other shapes: every thread must read the
    calling thread's packed input (a per-thread buffer, reused across calls), not a stale one of its own."""
    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(7)
    for m, n, k in [(5, 576, 576), (30, 192, 576), (64, 1536, 576), (30, 192, 576), (200, 576, 1536), (1, 192, 576)]:
        w, x = torch.randn(n, k, generator=g), torch.randn(m, k, generator=g)
        y = ext.packed_linear(x, ext.pack_linear_weight(w), n)
        torch.testing.assert_close(y, F.linear(x, w), rtol=1e-5, atol=1e-4 * k ** 0.5)


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
                    reason="the AVX-512 and AVX2 fp32 tiles only")
def test_fp32_rows_do_not_depend_on_the_batch(ext):
    """On AVX-512 and AVX2 CPUs every fp32 output is one FMA chain over the inputs in order, whatever the row count
    (read in place, split by panels or by rows): a row computed alone equals the same row inside any batch, bit for
    bit (greedy runs under preemption or prefix hits batch their rows differently and must not part)."""
    g = torch.Generator().manual_seed(3)
    for n, k in [(192, 576), (576, 1536), (37, 64)]:
        w = ext.pack_linear_weight(torch.randn(n, k, generator=g))
        x = torch.randn(64, k, generator=g)
        alone = torch.cat([ext.packed_linear(x[i:i + 1], w, n) for i in range(8)])
        for m in (2, 3, 7, 13, 64):
            assert torch.equal(ext.packed_linear(x[:m], w, n)[:8], alone[:m][:8]), (n, k, m)
        many = ext.packed_linear(torch.cat([x] * 4), w, n)  # 256 rows: past the 96-row cache blocks
        assert torch.equal(many[192:200], alone), (n, k)


@pytest.mark.parametrize("wdtype,xdtype,layout", [(torch.float32, torch.float32, "panels"),
                                                  (torch.bfloat16, torch.float32, "panels"),
                                                  (torch.bfloat16, torch.bfloat16, "panels"),
                                                  (torch.bfloat16, torch.float32, "vnni"),
                                                  (torch.bfloat16, torch.bfloat16, "vnni")])
@pytest.mark.parametrize("inter,k", [(96, 64), (48, 32), (1536, 576)])
def test_silu_mul_equals_the_product_then_silu_and_mul(ext, wdtype, xdtype, layout, inter, k):
    """silu(x W_gate^T + b) * (x W_up^T + b) in the GEMM's tiles (the [M, 2I] product never written) against the
    fused product then the separate silu_and_mul op; 48: an odd number of gate panels (a last single pair). vnni:
    the VNNI pair layout's tiles (AVX512-BF16; elsewhere the product, then the op)."""
    g = torch.Generator().manual_seed(inter + k)
    w = (torch.randn(2 * inter, k, generator=g) * 0.1).to(wdtype)
    packed = ext.pack_linear_weight(w) if layout == "panels" else ext.pack_linear_weight_vnni(w)
    for m in (1, 5, 13, 100, 200):  # 200: threads split the rows, each over every panel
        x = torch.randn(m, k, generator=g).to(xdtype)
        for bias in (None, torch.randn(2 * inter, generator=g)):
            gate_up = ext.packed_linear(x, packed, 2 * inter, bias)
            want = ext.silu_and_mul(gate_up[:, :inter], gate_up[:, inter:])
            got = ext.packed_linear_silu_mul(x, packed, 2 * inter, bias)
            assert got.shape == (m, inter) and got.dtype == xdtype
            if layout == "panels" and torch.backends.cpu.get_cpu_capability() == "AVX2":
                assert torch.equal(got, want)  # the AVX2 tiles end in the unfused op's own silu_and_mul_row
            elif xdtype == torch.float32:
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
            else:  # bf16: roundings where the unfused ops round; exp differs by an ulp before them
                torch.testing.assert_close(got.float(), want.float(), rtol=1.6e-2, atol=1e-3)
    x3 = torch.randn(2, 3, k, generator=g).to(xdtype)  # leading dims kept
    assert ext.packed_linear_silu_mul(x3, packed, 2 * inter).shape == (2, 3, inter)


def test_silu_mul_nan_stays_in_its_row_and_bad_widths_raise(ext):
    w = torch.randn(192, 64)
    packed = ext.pack_linear_weight(w)
    x = torch.randn(5, 64)
    x[2, 3] = float("nan")
    y = ext.packed_linear_silu_mul(x, packed, 192)
    assert y[2].isnan().all() and not y[[0, 1, 3, 4]].isnan().any()
    y = ext.packed_linear_silu_mul(x.bfloat16(), ext.pack_linear_weight_vnni(w.bfloat16()), 192)
    assert y[2].isnan().all() and not y[[0, 1, 3, 4]].isnan().any()
    with pytest.raises(RuntimeError, match="out_features"):
        ext.packed_linear_silu_mul(x, packed, 160)  # not all of the packed weight
    with pytest.raises(RuntimeError, match="out_features"):
        ext.packed_linear_silu_mul(x, ext.pack_linear_weight(torch.randn(80, 64)), 80)  # halves of 40: not panels
    with pytest.raises(RuntimeError, match="last dimension"):
        ext.packed_linear_silu_mul(torch.randn(5, 32), packed, 192)


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
                    reason="the AVX-512 and AVX2 fused tiles only")
def test_silu_mul_rows_do_not_depend_on_the_batch(ext):
    """As the plain linear's (below): a prompt's rows get the same values alone, in a short chunk after a cached
    prefix, or among hundreds (past the 96-row cache blocks)."""
    g = torch.Generator().manual_seed(5)
    w = ext.pack_linear_weight(torch.randn(3072, 576, generator=g) * 0.05)
    x = torch.randn(470, 576, generator=g)
    full = ext.packed_linear_silu_mul(x, w, 3072)
    for a, b in ((0, 1), (64, 72), (90, 100), (460, 470)):
        assert torch.equal(ext.packed_linear_silu_mul(x[a:b].clone(), w, 3072), full[a:b]), (a, b)


def test_a_vnni_call_after_an_in_place_fp32_call_reads_its_own_input(ext, monkeypatch):
    """The per-thread input buffer is shared by every packed layout: after a call that read its fp32 x in place
    (and split rows between threads), a call on VNNI pairs must fill and read its own input, not the stale
    pointer (it read freed memory: wrong values, then a crash, in the CI order of the tests)."""
    g = torch.Generator().manual_seed(11)
    w = torch.randn(64, 96, generator=g)
    x = torch.randn(300, 96, generator=g)
    ext.packed_linear(x, ext.pack_linear_weight(w), 64)  # >= 192 fp32 rows: in place, rows split
    del x
    wb = torch.randn(48, 64, generator=g).bfloat16()
    packed = ext.pack_linear_weight_vnni(wb)
    for m in (1, 5, 300):
        xb = torch.randn(m, 64, generator=g).bfloat16()
        want = (xb.float() @ wb.float().t()).bfloat16()
        torch.testing.assert_close(ext.packed_linear(xb, packed, 48), want, rtol=1.6e-2, atol=1e-2)

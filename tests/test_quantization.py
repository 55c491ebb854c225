"""Weight-only int4 linears (quantization="int4"): the kernel against a dequantized reference, the
Q4_1 grid recovered exactly, and the engine end to end."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pagedcore import LLM, SamplingParams
from pagedcore.quantization import GROUP_SIZE, Int4Linear, quantize_int4


def q4_1_weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """A weight on a Q4_1 grid, as the bundled GGUF stores it: per 32 values w = q * d + m with fp16 d and m,
    q = 0 and 15 used."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k // GROUP_SIZE, GROUP_SIZE), generator=g)
    q[..., 0], q[..., 1] = 0, 15
    d = (torch.rand(n, k // GROUP_SIZE, 1, generator=g) * 0.02 + 1e-3).half().float()
    m = (torch.randn(n, k // GROUP_SIZE, 1, generator=g) * 0.05).half().float()
    return (q * d + m).view(n, k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_int4_linear_reproduces_q4_1_weights(dtype, rows, monkeypatch):
    """The weight grid, exactly: fp32 activations at every M (decode rows' int8 activations: below)."""
    from pagedcore import quantization

    monkeypatch.setattr(quantization, "INT8_ACTIVATION_ROWS", 0)
    w = q4_1_weight(96, 128)
    lin = nn.Linear(128, 96, bias=True)
    with torch.no_grad():
        lin.weight.copy_(w)
    x = torch.randn(rows, 128)
    ref = x.double() @ w.double().T + lin.bias.double()
    out = Int4Linear(lin.to(dtype), dtype)(x.to(dtype))
    assert out.dtype == dtype and out.shape == (rows, 96)
    assert not out.isnan().any()
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert err < (1e-5 if dtype == torch.float32 else 1e-2), err


@pytest.mark.parametrize("rows", [1, 4])
def test_int4_linear_decode_rows_use_int8_activations(rows):
    """Decode rows by default: activations quantized per 32 inputs, error within int8 rounding of x."""
    from pagedcore import quantization

    if quantization.cpu_ext.load() is None:
        pytest.skip("torch's int4 kernel (no C++ ops) keeps the activations as they are")
    assert rows <= quantization.INT8_ACTIVATION_ROWS
    w = q4_1_weight(96, 128, seed=rows)
    lin = nn.Linear(128, 96, bias=False)
    with torch.no_grad():
        lin.weight.copy_(w)
    x = torch.randn(rows, 128)
    out = Int4Linear(lin, torch.float32)(x)
    ref = x.double() @ w.double().T
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert 1e-5 < err < 2e-2, err  # not the exact path, and no more than int8 rounding of x (measured ~5e-3)


def test_scale_panels_are_fp16_exactly_when_every_scale_and_min_is_one():
    """Scales and mins take fp16 panels (half the bytes) only where that changes no value: pagedcore's own
    int4 and GGUF's fp16 d / m; an asymmetric checkpoint's min = -zero * scale stays fp32."""
    from pagedcore import quantization

    if quantization.cpu_ext.load() is None:
        pytest.skip("torch's int4 kernel keeps its own scale layout")
    lin = nn.Linear(128, 48, bias=False)
    assert Int4Linear(lin, torch.float32).scales_and_zeros.dtype == torch.float16
    g = torch.Generator().manual_seed(5)
    q = torch.randint(0, 16, (48, 64), generator=g, dtype=torch.uint8)
    scale = (torch.rand(48, 2, generator=g) * 0.02 + 1e-3).half().float()
    zero = torch.randint(0, 16, (48, 2), generator=g).float()
    lo = -zero * scale  # GPTQ's: 4 bits more mantissa than an fp16 holds
    assert not quantization.exactly_fp16(lo)
    assert Int4Linear.from_codes(q, scale, lo, None, torch.float32, 32).scales_and_zeros.dtype == torch.float32
    assert Int4Linear.from_codes(q, scale, -8 * scale, None, torch.float32, 32).scales_and_zeros.dtype == torch.float16
    # the same grid as scale and zero point: 16 bits a pair, min = -zero * scale formed in the kernel
    zp = Int4Linear.from_zero_points(q, scale, zero, None, torch.float32, 32)
    assert zp.zero_point and zp.scales_and_zeros.dtype == torch.float16
    scale32 = Int4Linear.from_zero_points(q, scale + 1e-7, zero, None, torch.float32, 32)  # not fp16 scales
    assert not scale32.zero_point and scale32.scales_and_zeros.dtype == torch.float32


@pytest.mark.parametrize("rows", [1, 3, 40])
@pytest.mark.parametrize("int8_rows", [0, 8])
def test_zero_point_panels_equal_fp32_min_panels(rows, int8_rows):
    """(q - z) * s from fp16 scale and zero point: -z * s is exact in fp32, so the outputs are the bits of
    the fp32 (scale, min) panels, and match the dequantized weight."""
    from pagedcore.kernels import cpu_ext

    ext = cpu_ext.load()
    if ext is None:
        pytest.skip("no C++ ops")
    g = torch.Generator().manual_seed(10 + rows)
    q = torch.randint(0, 16, (48, 128), generator=g, dtype=torch.uint8)
    scale = (torch.rand(48, 2, generator=g) * 0.02 + 1e-3).half()
    zero = torch.randint(0, 16, (48, 2), generator=g).half()
    x = torch.randn(rows, 128, generator=g)
    lo = -zero.float() * scale.float()
    packed, sm32 = ext.pack_int4_weight(q, scale.float(), lo, 64)
    _, sm16 = ext.pack_int4_weight(q, scale, zero, 64)
    want = ext.packed_linear_int4(x, packed, sm32, 48, 64, None, int8_rows)
    got = ext.packed_linear_int4(x, packed, sm16, 48, 64, None, int8_rows, zero_point=True)
    assert torch.equal(got, want)
    w = ((q.double().view(48, 2, 64) - zero.double()[..., None]) * scale.double()[..., None]).view(48, 128)
    ref = x.double() @ w.T
    assert ((got.double() - ref).norm() / ref.norm()) < (2e-2 if int8_rows >= rows else 1e-6)
    with pytest.raises(RuntimeError, match="zero points: fp16"):
        ext.packed_linear_int4(x, packed, sm32, 48, 64, None, int8_rows, zero_point=True)


@pytest.mark.parametrize("rows", [1, 3, 40])
@pytest.mark.parametrize("int8_rows", [0, 8])
def test_fp16_and_fp32_scale_panels_give_identical_outputs(rows, int8_rows):
    """The kernel widens fp16 scales to fp32 before use: the same values give the same bits either way."""
    from pagedcore.kernels import cpu_ext

    ext = cpu_ext.load()
    if ext is None:
        pytest.skip("no C++ ops")
    g = torch.Generator().manual_seed(rows)
    q = torch.randint(0, 16, (40, 96), generator=g, dtype=torch.uint8)
    scale = (torch.rand(40, 3, generator=g) * 0.02 + 1e-3).half()
    lo = (torch.randn(40, 3, generator=g) * 0.05).half()
    x = torch.randn(rows, 96, generator=g)
    outs = []
    for s, m in ((scale.float(), lo.float()), (scale, lo)):
        packed, sm = ext.pack_int4_weight(q, s, m, 32)
        assert sm.dtype == s.dtype
        outs.append(ext.packed_linear_int4(x, packed, sm, 40, 32, None, int8_rows))
    assert torch.equal(outs[0], outs[1])
    w = (q.double().view(40, 3, 32) * scale.double()[..., None] + lo.double()[..., None]).view(40, 96)
    ref = x.double() @ w.T
    assert ((outs[1].double() - ref).norm() / ref.norm()) < (2e-2 if int8_rows >= rows else 1e-6)


def test_checkpoint_codes_keep_fp32_activations_at_decode_rows():
    """W4A16 checkpoints (from_codes) define their output with unquantized activations: exact at M = 1."""
    g = torch.Generator().manual_seed(3)
    q = torch.randint(0, 16, (48, 64), generator=g, dtype=torch.uint8)
    scale, lo = torch.rand(48, 2, generator=g) * 0.02, torch.randn(48, 2, generator=g) * 0.05
    w = (q.double().view(48, 2, 32) * scale.double()[..., None] + lo.double()[..., None]).view(48, 64)
    x = torch.randn(1, 64, generator=g)
    out = Int4Linear.from_codes(q, scale, lo, None, torch.float32, 32)(x)
    torch.testing.assert_close(out.double(), x.double() @ w.T, rtol=1e-5, atol=1e-5)


def test_int4_activations_setting_is_checked():
    from pagedcore.quantization import int8_activation_rows

    assert int8_activation_rows("fp32") == 0 and int8_activation_rows("int8") > 0
    with pytest.raises(ValueError, match="PAGEDCORE_INT4_ACTIVATIONS.*supported: int8, fp32"):
        int8_activation_rows("int4")


def test_quantize_replaces_linears_and_refuses_cuda():
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 16), nn.Linear(16, 16), nn.Linear(32, 8))
    assert quantize_int4(model, torch.device("cpu")) == 2  # widths the kernel cannot take stay as they are
    assert [type(m).__name__ for m in model] == ["Int4Linear", "ReLU", "Int4Linear", "Linear", "Linear"]
    with pytest.raises(ValueError, match="CPU"):
        quantize_int4(nn.Sequential(nn.Linear(64, 32)), torch.device("cuda"))


def test_engine_int4_generates_and_frees_blocks(tiny_model_dir):
    llm = LLM(str(tiny_model_dir("llama")), dtype="bfloat16", quantization="int4", num_kv_blocks=64)
    outs = llm.generate([[5, 6, 7, 8], list(range(100, 140))],
                        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [12, 12]
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def test_invalid_quantization_is_a_clear_error():
    with pytest.raises(ValueError, match="quantization"):
        LLM("unused", quantization="int3")


# Where the two runs part, the token each chose must be a near-tie in both: the two tokens' logprobs within
# NEAR_TIE nats. bf16 logits step by 1/16-1/8 at these magnitudes, so exact ties are common and the length of
# the common prefix is chaotic (measured [27, 5, 28, 48, 48, 0, 19, 24] on the AVX2 EPYC, [5, 5, 18, 48, 48,
# 6, 19, 30] on the AMX Xeon, [0, 25, 12, 10, 20, 12, 9, 2] there once the embedding came from the int4 head);
# the gaps at the parting were 0-0.5 nats in both Xeon runs. A broken int8 path parts at non-ties (nats).
NEAR_TIE = 1.0


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def gap(logprobs: dict, chosen: int, other: int) -> float:
    """How far `chosen` led `other` at one step (inf if `other` is not among the step's top logprobs)."""
    return logprobs[chosen].logprob - logprobs[other].logprob if other in logprobs else float("inf")


@pytest.mark.slow
def test_int8_activations_agree_with_fp32_activations_on_smollm2(smollm2_dir, chat_prompt_ids, monkeypatch):
    """The bundled model, int4 weights, greedy: decode with int8 activations (llama.cpp's scheme) against
    fp32 activations, 8 chat prompts one at a time x 48 tokens. Quantizing activations changes the numerics,
    so the runs may part, but only at a near-tie of the two tokens in both runs.

    In an fp32 model, where a logprob gap is measured to its last bits: in bf16 the model's own roundings part
    runs by as much (AMD Zen 3, session 28: bf16 against fp32 activations, both exact, parted at gaps up to 0.99
    nats, and the logits' bf16 steps are 1/8-1/4 nat here), so a 1-nat bound judged bf16's noise, not int8's
    (int8 against exact in bf16 parted once at exactly 1.0 there; in fp32 at most 0.24). The bf16 int8 path's
    own results: tests/test_packed_linear_int4.py."""
    from pagedcore import quantization

    # No prefix cache: with it the int8 run reused the fp32 run's prompt blocks and computed only a prompt's tail
    # after them, at <= 8 rows with int8 activations, so it measured a mix that depends on where the prompt's
    # 16-token blocks end (on an AMD Zen 4 one prompt then parted 1.4 nats off a tie; each run alone: <= 0.25).
    llm = LLM(str(smollm2_dir), dtype="float32", quantization="int4", num_kv_blocks=256, enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logprobs=5)
    runs = {}
    for rows in (0, quantization.int8_activation_rows("int8")):
        monkeypatch.setattr(quantization, "INT8_ACTIVATION_ROWS", rows)
        # One prompt at a time: decode rows of one sequence (M = 1), the single-stream case.
        runs[rows] = [llm.generate([p], params, use_tqdm=False)[0].outputs[0] for p in chat_prompt_ids]
    exact, int8 = runs.values()
    parted = []
    for a, b in zip(exact, int8):
        assert len(b.token_ids) == 48
        assert all(torch.tensor([lp[t].logprob for t in lp]).isfinite().all() for lp in b.logprobs)
        t = common_prefix(a.token_ids, b.token_ids)
        if t < 48:
            x, y = a.token_ids[t], b.token_ids[t]
            parted.append((t, round(gap(a.logprobs[t], x, y), 3), round(gap(b.logprobs[t], y, x), 3)))
    print("int8 vs fp32 activations, (step, fp32 gap, int8 gap) where they part:", parted)
    assert all(g1 < NEAR_TIE and g2 < NEAR_TIE for _, g1, g2 in parted), parted


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group_size", [None, 32])
def test_int8_linear_equals_its_dequantized_weight(dtype, group_size):
    from pagedcore.quantization import Int8Linear

    g = torch.Generator().manual_seed(0)
    q = torch.randint(-127, 128, (48, 128), generator=g, dtype=torch.int8)
    scale = torch.rand(48, 1 if group_size is None else 128 // group_size, generator=g) * 0.01 + 1e-3
    bias = torch.randn(48, generator=g)
    w = (q.double().view(48, scale.shape[1], -1) * scale.double()[..., None]).view(48, 128)
    x = torch.randn(2, 5, 128, generator=g)
    ref = x.double() @ w.T + bias.double()
    out = Int8Linear(q, scale, bias, dtype, group_size)(x.to(dtype))
    assert out.dtype == dtype and out.shape == (2, 5, 48)
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert err < (1e-6 if dtype == torch.float32 else 1e-2), err


def q8_blocks(x: torch.Tensor) -> torch.Tensor:
    """x through llama.cpp's Q8 activation blocks (32 inputs, d = max|x| / 127, round to nearest), fp32 d."""
    blocks = x.double().view(*x.shape[:-1], -1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    return (torch.round(blocks / d) * d).view(x.shape)


@pytest.mark.parametrize("group_size", [None, 32, 64])
@pytest.mark.parametrize("rows", [1, 2, 5])
def test_int8_linear_decode_rows_with_int8_activations(group_size, rows):
    """Q8_0 x Q8_0 (GGUF, as llama.cpp): decode rows' activations quantized per 32 inputs, integer dots;
    equal to the de-quantized weight times the de-quantized activation blocks, to fp32 summation order."""
    from pagedcore import quantization
    from pagedcore.quantization import Int8Linear

    if quantization.cpu_ext.load() is None:
        pytest.skip("torch's int8 path keeps the activations as they are")
    g = torch.Generator().manual_seed(rows)
    q = torch.randint(-128, 128, (40, 128), generator=g, dtype=torch.int8)  # -128 too: |w| as unsigned
    scale = (torch.rand(40, 1 if group_size is None else 128 // group_size, generator=g) * 0.01 + 1e-3).half()
    w = (q.double().view(40, scale.shape[1], -1) * scale.double()[..., None]).view(40, 128)
    x = torch.randn(rows, 128, generator=g)
    layer = Int8Linear(q, scale.float(), None, torch.float32, group_size, int8_activations=True)
    assert layer.scale.dtype == torch.float16  # every scale an fp16: 16 bits each
    out = layer(x).double()
    want = q8_blocks(x) @ w.T
    torch.testing.assert_close(out, want, atol=1e-5 * want.abs().max().item(), rtol=1e-5)
    assert (out - x.double() @ w.T).abs().max() > 1e-4 * want.abs().max()  # the activations were quantized
    exact = Int8Linear(q, scale.float(), None, torch.float32, group_size)(x).double()  # W8A16: fp32 activations
    torch.testing.assert_close(exact, x.double() @ w.T, atol=1e-5, rtol=1e-5)


def test_int8_linear_odd_shapes_and_bf16():
    """Widths the panels pad (37 outputs), inputs no multiple of 32 (per channel: fp32 activations at every M)."""
    from pagedcore.quantization import Int8Linear

    g = torch.Generator().manual_seed(1)
    q = torch.randint(-127, 128, (37, 100), generator=g, dtype=torch.int8)
    scale = torch.rand(37, 1, generator=g) * 0.01 + 1e-3
    w = q.double() * scale.double()
    for dtype in (torch.float32, torch.bfloat16):
        layer = Int8Linear(q, scale, torch.ones(37), dtype, None, int8_activations=True)
        for rows in (1, 3, 17):
            x = torch.randn(rows, 100, generator=g)
            out = layer(x.to(dtype))
            assert out.dtype == dtype and out.shape == (rows, 37) and not out.isnan().any()
            ref = x.double() @ w.T + 1
            assert ((out.double() - ref).norm() / ref.norm()) < (1e-6 if dtype == torch.float32 else 1e-2)

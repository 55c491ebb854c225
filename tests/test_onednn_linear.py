"""bf16 linears through oneDNN's pre-packed matmul (pagedcore/onednn_linear.py), forced on whatever the CPU:
oneDNN runs without AMX too, so these hold on CI machines that would never pick it themselves (not on AVX2-only
CPUs: there oneDNN packs no bf16 weight, and prepack leaves the panels running, tested here)."""

from __future__ import annotations

import pytest
import torch

from linear_helpers import check_leading_dims_strided_input_and_nan
from pagedcore import LLM, SamplingParams, fused_projections, onednn_linear, packed_linear, vnni_layout


@pytest.fixture(autouse=True)
def panels_layout(monkeypatch):
    """oneDNN's copy sits beside the panels: with the VNNI pairs (AMX CPUs' default) there is none."""
    monkeypatch.setattr(vnni_layout, "SETTING", "off")


@pytest.fixture
def onednn_from(monkeypatch):
    if not onednn_linear.available():
        pytest.skip("oneDNN packs no bf16 weights on this CPU (it needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT)")

    def set_rows(rows):
        monkeypatch.setattr(onednn_linear, "ROWS", rows)
    return set_rows


@pytest.mark.parametrize("m", [1, 3, 4, 17, 200])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_is_fp32_math_rounded_once(ext, onednn_from, m, bias):
    """Above the row bound the patched linear runs oneDNN; its bf16 output is the fp32 product rounded once, as
    the panels' is (both may differ from the float64 product rounded in a rare last-bit tie)."""
    onednn_from(4)
    torch.manual_seed(m)
    linear = torch.nn.Linear(96, 200, bias=bias, dtype=torch.bfloat16)
    x = torch.randn(m, 96, dtype=torch.bfloat16)
    packed_linear.install(linear, torch.device("cpu"))
    assert linear._pagedcore_onednn is not None and linear._pagedcore_onednn.is_mkldnn
    with torch.inference_mode():
        got = linear(x)
    want = x.double() @ linear.weight.double().T + (linear.bias.double() if bias else 0)
    assert got.dtype == torch.bfloat16 and got.shape == (m, 200)
    assert (got.double() - want).abs().max() <= want.abs().max() * 2 ** -8
    assert (got != want.bfloat16()).float().mean() < 0.01
    assert onednn_linear.runs(x, linear._pagedcore_onednn) == (m >= 4)


def test_leading_dims_strided_input_and_nan(ext, onednn_from):
    onednn_from(1)
    linear = torch.nn.Linear(64, 48, dtype=torch.bfloat16)
    packed_linear.install(linear, torch.device("cpu"))
    check_leading_dims_strided_input_and_nan(linear, 5)


def test_only_bf16_and_only_when_on(ext, onednn_from):
    onednn_from(None)
    assert onednn_linear.prepack(torch.randn(32, 16, dtype=torch.bfloat16)) is None
    onednn_from(2)
    assert onednn_linear.prepack(torch.randn(32, 16)) is None  # fp32 stays on the panels
    assert onednn_linear.prepack(torch.randn(32, 16, dtype=torch.bfloat16)) is not None


@pytest.mark.parametrize("setting,rows", [("off", None), ("7", 7), ("1", 1)])
def test_setting(setting, rows):
    assert onednn_linear._rows_from(setting) == rows


@pytest.mark.parametrize("setting", ["0", "yes", "-3", ""])
def test_bad_setting_is_a_clear_error(setting):
    with pytest.raises(ValueError, match="PAGEDCORE_ONEDNN"):
        onednn_linear._rows_from(setting)


def test_engine_same_tokens_as_the_panels(ext, tiny_model_dir, onednn_from):
    """bf16 engine: oneDNN from 3 rows against the panels everywhere - the same greedy tokens and logprobs to
    bf16's tolerance over prefill, batch 1-2 (the stack on panels) and batch 5 (the stack over oneDNN)."""
    prompts = [[5 + i for i in range(n)] for n in (3, 20, 41, 9, 14)]
    params = SamplingParams(temperature=0, max_tokens=10, logprobs=2)
    runs = {}
    for rows in (None, 3):
        onednn_from(rows)
        llm = LLM(str(tiny_model_dir("llama")), dtype="bfloat16", num_kv_blocks=64)
        runner = llm.engine.runner
        fused = fused_projections.installed(llm.engine.model)
        assert fused and all(f.onednn == (rows is not None) for f in fused)
        assert all(f.fuses(2) and f.fuses(64) == (rows is not None) for f in fused)
        # the fused copy replaces the members' own
        assert all(m._pagedcore_onednn is None for f in fused for m in f.members) or rows is None
        # the stack runs oneDNN's linears itself from `rows` rows (test_decode_stack.py: bit for bit)
        assert runner.decode_stack is not None and runner.decode_stack.onednn_rows == (rows or 0)
        runs[rows] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        runs[rows] += [o.outputs[0] for o in llm.generate(prompts[:2], params, use_tqdm=False)]
        runs[rows] += [o.outputs[0] for o in llm.generate(prompts[:1], params, use_tqdm=False)]
    for a, b in zip(runs[None], runs[3]):
        assert a.token_ids == b.token_ids
        for tok, sa, sb in zip(a.token_ids, a.logprobs, b.logprobs):
            assert abs(sa[tok].logprob - sb[tok].logprob) < 0.1


def test_fused_projection_through_onednn(ext, onednn_from):
    """q/k/v fused: from ROWS rows one oneDNN call over the concatenated weight, each member's slice the
    fp32 product rounded once, as the member's own linear gives it on the panels."""
    onednn_from(4)
    torch.manual_seed(0)
    attn = torch.nn.Module()
    attn.q_proj, attn.k_proj, attn.v_proj = (torch.nn.Linear(64, n, bias=True, dtype=torch.bfloat16)
                                             for n in (96, 32, 32))
    layer = torch.nn.Module()
    layer.self_attn = attn
    packed_linear.install(layer, torch.device("cpu"))
    assert fused_projections.install(layer, torch.device("cpu")) == 1
    fused = fused_projections.get(attn, ("q_proj", "k_proj", "v_proj"))
    assert fused.onednn and fused.fuses(40)
    x = torch.randn(40, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        got = fused(x)
    for out, m in zip(got, fused.members):
        want = x.double() @ m.weight.double().T + m.bias.double()
        assert (out.double() - want).abs().max() <= want.abs().max() * 2 ** -8


def test_weight_bytes_count_the_onednn_copy(ext, tiny_model_dir, onednn_from):
    from pagedcore.bench import weights

    totals = {}
    for rows in (None, 4):
        onednn_from(rows)
        llm = LLM(str(tiny_model_dir("llama")), dtype="bfloat16", num_kv_blocks=16)
        linears = [m for m in llm.engine.model.modules() if hasattr(m, "_pagedcore_packed")]
        dense = sum(m.out_features * m.in_features * 2 for m in linears)
        totals[rows] = weights.weight_bytes("", llm.engine.model).linear
    assert totals[4] - totals[None] == dense


def test_where_onednn_cannot_pack_the_panels_run(monkeypatch):
    monkeypatch.setattr(onednn_linear, "ROWS", 3)
    monkeypatch.setattr(onednn_linear, "available", lambda: False)
    assert onednn_linear.prepack(torch.randn(32, 16, dtype=torch.bfloat16)) is None


def test_available_says_whether_the_reorder_runs():
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 32, dtype=torch.bfloat16), 1)
        ran = True
    except RuntimeError:
        ran = False
    assert onednn_linear.available() == ran

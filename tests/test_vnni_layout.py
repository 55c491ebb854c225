"""bf16 linears over weights in VNNI pairs (pagedcore/vnni_layout.py, kernels/csrc/cpu_gemm_vnni.cpp): AMX tiles
where the CPU has them (ext.vnni_amx()), else AVX512-BF16's vdpbf16ps tiles (ext.vnni_dpbf16()), else the scalar
loop over the same layout, so these hold on any CI machine."""

from __future__ import annotations

import pytest
import torch

from linear_helpers import check_leading_dims_strided_input_and_nan
from pagedcore import LLM, SamplingParams, fused_projections, onednn_linear, packed_linear, vnni_layout

# AMX: 16-row tiles, 32-row blocks; vdpbf16ps: 6-row tiles, 96-row blocks; and their edges
ROW_COUNTS = [1, 2, 3, 5, 6, 7, 15, 16, 17, 31, 32, 33, 64, 96, 97, 100, 200]


@pytest.fixture
def pairs(monkeypatch):
    monkeypatch.setattr(vnni_layout, "SETTING", "on")
    monkeypatch.setattr(onednn_linear, "ROWS", None)


def _rounded_once(got: torch.Tensor, want: torch.Tensor) -> None:
    """The fp32 product rounded once to bf16: within half a bf16 ulp of the float64 product, plus fp32 sums'
    error, and equal to it rounded in all but rare last-bit ties."""
    assert not torch.isnan(got).any()
    assert (got.double() - want).abs().max() <= want.abs().max() * 2 ** -8
    assert (got != want.bfloat16()).float().mean() < 0.01


@pytest.mark.parametrize("m", ROW_COUNTS)
# (400, 1536): 25 panels, past one AMX block of panel pairs (BLOCK_BYTES: 10 panels at K = 1536) and one left over
@pytest.mark.parametrize("n,k,bias", [(40, 64, True), (200, 96, False), (96, 1536, True), (400, 1536, False)])
def test_op_is_fp32_math_rounded_once(ext, m, n, k, bias):
    torch.manual_seed(m + n)
    w = torch.randn(n, k, dtype=torch.bfloat16)
    b = torch.randn(n) if bias else None
    x = torch.randn(m, k, dtype=torch.bfloat16)
    packed = ext.pack_linear_weight_vnni(w)
    assert packed.shape == ((n + 15) // 16, k // 2, 32) and vnni_layout.is_packed(packed)
    got = ext.packed_linear(x, packed, n, b)
    want = x.double() @ w.double().T + (b.double() if bias else 0)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    _rounded_once(got, want)
    # the panels' op: the same sums in another order
    panels = ext.packed_linear(x, ext.pack_linear_weight(w), n, b)
    assert (got.float() - panels.float()).abs().max() <= want.abs().max() * 2 ** -7


def test_a_row_is_the_same_bits_in_any_call(ext):
    """A row's result does not depend on the rows beside it: threads split a prompt's rows (each over every panel)
    past 192 rows and the panels below, and both give each row the same sums in the same order."""
    torch.manual_seed(3)
    w, x = torch.randn(200, 576, dtype=torch.bfloat16), torch.randn(300, 576, dtype=torch.bfloat16)
    packed = ext.pack_linear_weight_vnni(w)
    many = ext.packed_linear(x, packed, 200, None)
    for r0, r1 in ((0, 1), (2, 6), (5, 13), (100, 200), (290, 300)):
        assert torch.equal(ext.packed_linear(x[r0:r1], packed, 200, None), many[r0:r1])
    gate_up = ext.pack_linear_weight_vnni(torch.randn(192, 576, dtype=torch.bfloat16))
    many = ext.packed_linear_silu_mul(x, gate_up, 192, None)
    for r0, r1 in ((7, 19), (0, 1), (3, 7)):  # up to 4 rows the vdpbf16ps tiles read four streams of panels
        assert torch.equal(ext.packed_linear_silu_mul(x[r0:r1], gate_up, 192, None), many[r0:r1])


@pytest.mark.parametrize("panels", [1, 2, 3, 5, 8, 9, 13, 18])
def test_few_rows_stream_any_panel_count(ext, panels):
    """Up to 4 rows each thread reads its panels as up to four streams (a share of 1-9 panels: streams of unequal
    length, the last ones ending early): every column of a bias-added product, and of silu(gate) * up, equals the
    row's bits in a 12-row call (the 6-row tiles) and the fp32 product rounded once, to the sums' error."""
    torch.manual_seed(panels)
    n = 16 * panels - 3  # the last panel part padding
    w, b, x = torch.randn(n, 96, dtype=torch.bfloat16), torch.randn(n), torch.randn(12, 96, dtype=torch.bfloat16)
    packed = ext.pack_linear_weight_vnni(w)
    many = ext.packed_linear(x, packed, n, b)
    gate_up = ext.pack_linear_weight_vnni(torch.randn(32 * panels, 96, dtype=torch.bfloat16))
    fused = ext.packed_linear_silu_mul(x, gate_up, 32 * panels, None)
    for rows in (1, 2, 4):
        got = ext.packed_linear(x[:rows], packed, n, b)
        assert torch.equal(got, many[:rows])
        want = x[:rows].double() @ w.double().T + b.double()
        assert (got.double() - want).abs().max() <= want.abs().max() * 2 ** -8
        assert torch.equal(ext.packed_linear_silu_mul(x[:rows], gate_up, 32 * panels, None), fused[:rows])


def test_fp32_input_is_rounded_to_bf16(ext):
    """An fp32 x meets bf16 tiles rounded to bf16 (to nearest even), the output in fp32."""
    torch.manual_seed(1)
    w, x = torch.randn(48, 64, dtype=torch.bfloat16), torch.randn(5, 64)
    got = ext.packed_linear(x, ext.pack_linear_weight_vnni(w), 48, None)
    want = x.bfloat16().double() @ w.double().T
    assert got.dtype == torch.float32
    assert (got.double() - want).abs().max() <= want.abs().max() * 2 ** -20


def test_leading_dims_strided_input_and_nan(ext, pairs):
    linear = torch.nn.Linear(64, 48, dtype=torch.bfloat16)
    packed_linear.install(linear, torch.device("cpu"))
    assert vnni_layout.is_packed(linear._pagedcore_packed)
    check_leading_dims_strided_input_and_nan(linear, 20)


def test_which_weights_take_the_pairs(ext, pairs, monkeypatch):
    """bf16 with in_features a multiple of 32 (a tile's depth); fp32 and other widths keep the panels; off: none."""
    layers = {"bf16": torch.nn.Linear(64, 40, dtype=torch.bfloat16), "fp32": torch.nn.Linear(64, 40),
              "width": torch.nn.Linear(48, 40, dtype=torch.bfloat16)}
    for linear in layers.values():
        packed_linear.install(linear, torch.device("cpu"))
    assert {k: vnni_layout.is_packed(v._pagedcore_packed) for k, v in layers.items()} == {
        "bf16": True, "fp32": False, "width": False}
    monkeypatch.setattr(vnni_layout, "SETTING", "off")
    assert not vnni_layout.applies(ext, torch.zeros(8, 64, dtype=torch.bfloat16))
    monkeypatch.setattr(vnni_layout, "SETTING", "auto")
    assert vnni_layout.applies(ext, torch.zeros(8, 64, dtype=torch.bfloat16)) == (ext.vnni_amx() or ext.vnni_dpbf16())


def test_bad_shapes_and_settings_are_clear_errors(ext):
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ext.pack_linear_weight_vnni(torch.zeros(16, 48, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="bfloat16"):
        ext.pack_linear_weight_vnni(torch.zeros(16, 64))
    packed = ext.pack_linear_weight_vnni(torch.zeros(16, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="in_features"):
        ext.packed_linear(torch.zeros(2, 32, dtype=torch.bfloat16), packed, 16, None)
    with pytest.raises(ValueError, match="PAGEDCORE_VNNI"):
        vnni_layout._setting("yes")


def test_tied_embedding_reads_its_rows_from_the_pairs(ext, pairs):
    """With the dense weight released, a tied input embedding looks its rows up in the LM head's pairs."""
    torch.manual_seed(0)
    weight = torch.randn(50, 64, dtype=torch.bfloat16)
    packed = ext.pack_linear_weight_vnni(weight)
    ids = torch.tensor([[0, 17, 49], [3, 16, 15]])
    assert torch.equal(vnni_layout.rows(packed, ids), weight[ids])


def test_engine_same_tokens_as_the_panels(ext, tiny_model_dir, monkeypatch):
    """bf16 engine, every linear in pairs against the panels: the same greedy tokens and logprobs to bf16's
    tolerance over prefill and batches of 1, 2 and 5 (the decode stack and layer by layer), every block back."""
    monkeypatch.setattr(onednn_linear, "ROWS", None)
    prompts = [[5 + i for i in range(n)] for n in (3, 20, 41, 9, 14)]
    params = SamplingParams(temperature=0, max_tokens=10, logprobs=2)
    runs = {}
    for setting in ("off", "on"):
        monkeypatch.setattr(vnni_layout, "SETTING", setting)
        for stack in (True, False):
            llm = LLM(str(tiny_model_dir("llama")), dtype="bfloat16", num_kv_blocks=64, decode_stack=stack)
            fused = fused_projections.installed(llm.engine.model)
            assert fused and all(vnni_layout.is_packed(f.spec[0]) == (setting == "on") for f in fused)
            if stack:  # the RoPE table the stack keeps is the rotary module's, bit for bit (vector_math.py)
                ds = llm.engine.runner.decode_stack
                cos, sin = ds.base.rotary_emb(torch.zeros(1, 1, dtype=torch.bfloat16), torch.arange(len(ds._rope_table[0]))[None])
                assert torch.equal(ds._rope_table[0], cos[0]) and torch.equal(ds._rope_table[1], sin[0])
            out = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
            out += [o.outputs[0] for o in llm.generate(prompts[:2], params, use_tqdm=False)]
            out += [o.outputs[0] for o in llm.generate(prompts[:1], params, use_tqdm=False)]
            assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks
            runs[setting, stack] = out
    for key in (("on", True), ("on", False), ("off", False)):
        for a, b in zip(runs["off", True], runs[key]):
            assert a.token_ids == b.token_ids, key
            for tok, sa, sb in zip(a.token_ids, a.logprobs, b.logprobs):
                assert abs(sa[tok].logprob - sb[tok].logprob) < 0.1, key


def test_weights_resident_once(ext, tiny_model_dir, monkeypatch):
    """The pairs replace the panels (same bytes, as whole tiles) and no oneDNN copy sits beside them."""
    from pagedcore.bench import weights

    monkeypatch.setattr(onednn_linear, "ROWS", None)
    totals = {}
    for setting in ("off", "on"):
        monkeypatch.setattr(vnni_layout, "SETTING", setting)
        llm = LLM(str(tiny_model_dir("llama")), dtype="bfloat16", num_kv_blocks=16)
        assert all(getattr(m, "_pagedcore_onednn", None) is None for m in llm.engine.model.modules())
        totals[setting] = weights.weight_bytes("", llm.engine.model).linear
    assert totals["on"] == totals["off"]


@pytest.mark.skipif(not onednn_linear.available(), reason="oneDNN packs no bf16 weights on this CPU")
@pytest.mark.parametrize("m", [onednn_linear.PREFILL_ROWS - 1, onednn_linear.PREFILL_ROWS])
def test_onednn_beside_the_pairs_only_for_prefill(ext, monkeypatch, m):
    """oneDNN on (AMX CPUs' default, forced here): beside the pairs it keeps its copy for PREFILL_ROWS rows and
    more, where its blocking multiplies faster; below, the pairs run. Either way the fp32 product rounded once."""
    monkeypatch.setattr(vnni_layout, "SETTING", "on")
    monkeypatch.setattr(onednn_linear, "ROWS", 3)
    assert onednn_linear.min_rows(True) == onednn_linear.PREFILL_ROWS and onednn_linear.min_rows(False) == 3
    torch.manual_seed(m)
    linear = torch.nn.Linear(64, 48, dtype=torch.bfloat16)
    packed_linear.install(linear, torch.device("cpu"))
    assert vnni_layout.is_packed(linear._pagedcore_packed) and linear._pagedcore_onednn is not None
    x = torch.randn(m, 64, dtype=torch.bfloat16)
    assert onednn_linear.runs(x, linear._pagedcore_onednn, True) == (m >= onednn_linear.PREFILL_ROWS)
    with torch.inference_mode():
        got = linear(x)
    _rounded_once(got, x.double() @ linear.weight.double().T + linear.bias.double())


@pytest.mark.skipif(not onednn_linear.available(), reason="oneDNN packs no bf16 weights on this CPU")
def test_lm_head_keeps_no_onednn_copy_beside_its_pairs(ext, tiny_model_dir, monkeypatch):
    """The LM head sees one row per sampled sequence, below PREFILL_ROWS: beside the pairs it keeps no oneDNN
    copy (the other linears do); beside the panels (no AMX) oneDNN serves it from 3 rows, so it keeps one."""
    monkeypatch.setattr(onednn_linear, "ROWS", 3)
    for setting in ("on", "off"):
        monkeypatch.setattr(vnni_layout, "SETTING", setting)
        llm = LLM(str(tiny_model_dir("llama")), dtype="bfloat16", num_kv_blocks=16, enable_prefix_caching=False)
        model = llm.engine.model
        head = model.get_output_embeddings()
        layer = model.model.layers[0]  # o_proj and down_proj run unfused: their own copies
        assert layer.self_attn.o_proj._pagedcore_onednn is not None and layer.mlp.down_proj._pagedcore_onednn is not None
        assert (head._pagedcore_onednn is None) == (setting == "on")
        out = llm.generate([list(range(5, 200))], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4

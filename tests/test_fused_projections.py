"""q/k/v and gate/up fused into one matmul at decode (pagedcore/fused_projections.py) against the members."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pagedcore import LLM, SamplingParams, fused_projections, installs, packed_linear, quantization
from pagedcore.quantization import Int4Linear

CPU = torch.device("cpu")
QKV = fused_projections.GROUPS[0][1]
GATE_UP = fused_projections.GROUPS[1][1]


class Block(nn.Module):
    """The shape of an HF decoder layer, as far as fusing looks: self_attn.{q,k,v}_proj, mlp.{gate,up}_proj."""

    def __init__(self, hidden=64, q=64, kv=32, inter=96, bias=False):
        super().__init__()
        self.self_attn = nn.Module()
        for name, width in zip(QKV, (q, kv, kv)):
            setattr(self.self_attn, name, nn.Linear(hidden, width, bias=bias))
        self.mlp = nn.Module()
        for name in GATE_UP:
            setattr(self.mlp, name, nn.Linear(hidden, inter, bias=False))


def _block(dtype=torch.float32, **kw) -> nn.Module:
    torch.manual_seed(0)
    return Block(**kw).to(dtype).eval()


def _int4(block: nn.Module, dtype) -> nn.Module:
    for parent, names in ((block.self_attn, QKV), (block.mlp, GATE_UP)):
        for n in names:
            setattr(parent, n, Int4Linear(getattr(parent, n), dtype))
    return block


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_packed_fused_equals_members(ext, dtype, bias, rows):
    model = _block(dtype, bias=bias)
    packed_linear.install(model, CPU)
    x = torch.randn(1, rows, 64).to(dtype)
    with torch.inference_mode():
        alone = [[getattr(p, n)(x) for n in names] for p, names in ((model.self_attn, QKV), (model.mlp, GATE_UP))]
        assert fused_projections.install(model, CPU) == 2
        for (parent, names), want in zip(((model.self_attn, QKV), (model.mlp, GATE_UP)), alone):
            got = fused_projections.get(parent, names)(x)
            assert [t.shape for t in got] == [t.shape for t in want]
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
            # The members run alone over their panels of the fused weight, still correctly.
            for n, w in zip(names, want):
                torch.testing.assert_close(getattr(parent, n)(x), w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activations", [0, quantization.INT8_ACTIVATION_ROWS])
@pytest.mark.parametrize("rows", [1, 5])
def test_int4_fused_equals_members(ext, monkeypatch, dtype, activations, rows):
    monkeypatch.setattr(quantization, "INT8_ACTIVATION_ROWS", activations)
    model = _int4(_block(), dtype)
    x = torch.randn(1, rows, 64).to(dtype)
    with torch.inference_mode():
        want = [getattr(model.self_attn, n)(x) for n in QKV]
        assert fused_projections.install(model, CPU) == 2
        got = fused_projections.get(model.self_attn, QKV)(x)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
        for n, w in zip(QKV, want):
            torch.testing.assert_close(getattr(model.self_attn, n)(x), w, rtol=1e-5, atol=1e-5)


def test_members_are_views_of_the_fused_weight(ext):
    """The weight is resident once: each member's packed weight shares the fused one's storage."""
    model = _block(torch.bfloat16)
    packed_linear.install(model, CPU)
    fused_projections.install(model, CPU)
    members = [getattr(model.self_attn, n)._pagedcore_packed for n in QKV]
    assert len({m.untyped_storage().data_ptr() for m in members}) == 1
    assert sum(m.numel() for m in members) * members[0].element_size() == members[0].untyped_storage().nbytes()

    int4 = _int4(_block(), torch.float32)
    fused_projections.install(int4, CPU)
    assert len({getattr(int4.mlp, n).packed.untyped_storage().data_ptr() for n in GATE_UP}) == 1
    assert len({getattr(int4.mlp, n).scales_and_zeros.untyped_storage().data_ptr() for n in GATE_UP}) == 1


def test_a_replaced_member_wins(ext):
    """A module that replaces a projection afterwards (a LoRA wrapper, a plugin) turns fusing off for its group."""
    model = _block()
    packed_linear.install(model, CPU)
    fused_projections.install(model, CPU)
    assert fused_projections.get(model.self_attn, QKV) is not None
    model.self_attn.k_proj = nn.Linear(64, 32)
    assert fused_projections.get(model.self_attn, QKV) is None
    assert fused_projections.get(model.mlp, GATE_UP) is not None
    assert fused_projections.install(model, CPU) == 0  # idempotent; k_proj's group stays unfused
    # Patching a member's forward in place (as LoRA layers do) turns its group off too.
    model.mlp.up_proj.forward = lambda x: x
    assert fused_projections.get(model.mlp, GATE_UP) is None


def test_unfusable_groups_are_left_alone(ext):
    # Widths off the 16-column panel; members of different kinds; members not packed at all.
    assert fused_projections.install(_block(kv=24, inter=40), CPU) == 0
    mixed = _block()
    packed_linear.install(mixed, CPU)
    mixed.self_attn.v_proj = Int4Linear(mixed.self_attn.v_proj, torch.float32)
    assert fused_projections.install(mixed, CPU) == 1  # gate/up only
    assert fused_projections.install(_block(), CPU) == 0
    assert fused_projections.install(_block(), torch.device("meta")) == 0


def test_restore_takes_fusing_off(ext):
    model = _block()
    installs.track(model)
    packed_linear.install(model, CPU)
    fused_projections.install(model, CPU)
    assert installs.restore(model) == 3
    assert fused_projections.get(model.self_attn, QKV) is None
    assert not hasattr(model.self_attn.q_proj, "_pagedcore_packed")


@pytest.mark.parametrize("dtype,vnni", [("float32", "off"), ("bfloat16", "off"), ("bfloat16", "on")])
def test_engine_tokens_equal_with_and_without_fusing(ext, monkeypatch, tiny_model_dir, dtype, vnni):
    """Decode steps (<= FUSED_ROWS rows) take the fused path; with it off, the same tokens and logprobs. bf16
    weights in VNNI pairs (AMX CPUs) run fused at any row count, prefill too. (oneDNN, which also fuses
    prefill: test_onednn_linear.py.)"""
    from pagedcore import onednn_linear, vnni_layout

    monkeypatch.setattr(onednn_linear, "ROWS", None)
    monkeypatch.setattr(vnni_layout, "SETTING", vnni)
    prompts = [[5 + i for i in range(n)] for n in (3, 20, 41)]
    params = SamplingParams(temperature=0, max_tokens=10, logprobs=2)
    runs, calls, silu_calls = {}, [], []
    call = fused_projections.FusedProjection.__call__
    monkeypatch.setattr(fused_projections.FusedProjection, "__call__", lambda self, x: calls.append(x.shape) or call(self, x))
    for fuse in (True, False):
        if not fuse:
            monkeypatch.setattr(fused_projections, "install", lambda model, device: 0)
        # Layer by layer (the decode stack runs the fused weights in C++: tests/test_decode_stack.py).
        llm = LLM(str(tiny_model_dir("llama")), dtype=dtype, num_kv_blocks=64, decode_stack=False)
        layer = llm.engine.model.model.layers[0]
        assert (fused_projections.get(layer.self_attn, QKV) is not None) == fuse
        assert vnni_layout.is_packed(layer.self_attn.q_proj._pagedcore_packed) == (vnni == "on")
        for fused in fused_projections.installed(llm.engine.model):
            if fused.silu_mul is not None:  # gate/up with silu * up in the tiles, at any row count
                fused.silu_mul = lambda x, _f=fused.silu_mul: silu_calls.append(x.shape) or _f(x)
        runs[fuse] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    # 2 layers x q/k/v per decode step, at most FUSED_ROWS rows each, prefill only in VNNI pairs; gate/up (with
    # silu * up) 2 layers x every step, prompts included.
    prefill = [s for s in calls if s[-2] > fused_projections.FUSED_ROWS]
    assert len(calls) >= 2 * 9 and (len(prefill) >= 2 if vnni == "on" else not prefill)
    assert len(silu_calls) >= 2 * 10 and any(s[-2] > fused_projections.FUSED_ROWS for s in silu_calls)
    tol = 1e-4 if dtype == "float32" else 0.1
    for a, b in zip(runs[True], runs[False]):
        assert a.token_ids == b.token_ids
        for tok, sa, sb in zip(a.token_ids, a.logprobs, b.logprobs):
            assert abs(sa[tok].logprob - sb[tok].logprob) < tol

"""The lean CPU decoder-layer forward against transformers' own layer forward, inside the engine."""

from __future__ import annotations

import pytest
import torch

from pagedcore import LLM, SamplingParams, lean_layers



# Prompt lengths cross the tiny Mistral's sliding window (24) and several 16-token blocks.
PROMPTS = [[5 + i for i in range(n)] for n in (3, 29, 47)]


def _generate(model_dir, dtype, monkeypatch, lean: bool):
    with monkeypatch.context() as m:
        if not lean:
            m.setattr(lean_layers, "install", lambda model, device: 0)
        llm = LLM(str(model_dir), dtype=dtype, num_kv_blocks=64, block_size=16)
    layers = [x for x in llm.engine.model.modules() if type(x).__name__ in lean_layers.SUPPORTED_LAYERS]
    patched = ["_lean_forward" in x.forward.__qualname__ for x in layers]
    assert layers and all(p == lean for p in patched)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, logprobs=3), use_tqdm=False)
    return [o.outputs[0] for o in outs]


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_lean_layers_match_transformers_layers(ext, arch, dtype, tiny_model_dir, monkeypatch):
    model_dir = tiny_model_dir(arch)
    lean = _generate(model_dir, dtype, monkeypatch, lean=True)
    ref = _generate(model_dir, dtype, monkeypatch, lean=False)
    # fp32: only the fp32 RMSNorm sum order and silu's exp differ (ulps); bf16: the same ops round
    # at the same places, so differences are rare single-ulp flips.
    tol = 1e-4 if dtype == "float32" else 0.1
    for a, b in zip(lean, ref):
        assert a.token_ids == b.token_ids
        for tok, step_a, step_b in zip(a.token_ids, a.logprobs, b.logprobs):
            assert abs(step_a[tok].logprob - step_b[tok].logprob) < tol
            # The top-3 sets can differ only by a near-tie at the edge (bf16 logits are coarse).
            shared = step_a.keys() & step_b.keys()
            assert len(shared) >= (3 if dtype == "float32" else 2)
            assert all(abs(step_a[t].logprob - step_b[t].logprob) < tol for t in shared)


def test_a_module_replaced_after_start_up_runs(ext, tiny_model_dir):
    """An MLP swapped in after the engine started (a plugin, an adapter) runs, not the one the lean forward took
    at install: the layer's own forward takes the step, and the tokens stay (the new MLP wraps the old)."""
    llm = LLM(str(tiny_model_dir("llama")), num_kv_blocks=64, block_size=16)
    params = SamplingParams(temperature=0, max_tokens=6)
    before = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    layer, calls = llm.engine.model.model.layers[1], []

    class Counted(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            calls.append(x.shape)
            return self.inner(x)

    layer.mlp = Counted(layer.mlp)
    after = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert calls and after == before


def test_only_known_layers_are_patched(ext, tiny_model_dir):
    """Phi-3 (fused gate_up, its own layout) keeps transformers' forward."""
    llm = LLM(str(tiny_model_dir("phi3")), num_kv_blocks=16)
    layers = [m for m in llm.engine.model.modules() if type(m).__name__.endswith("DecoderLayer")]
    assert layers and not any("_lean_forward" in m.forward.__qualname__ for m in layers)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_ops_match_transformers_ops(ext, dtype):
    from transformers.models.llama.modeling_llama import (
        LlamaConfig,
        LlamaRMSNorm,
        LlamaRotaryEmbedding,
        apply_rotary_pos_emb,
    )

    torch.manual_seed(0)
    T, Hq, Hk, D = 37, 9, 3, 64
    q, k = torch.randn(T, Hq * D).to(dtype), torch.randn(T, Hk * D).to(dtype)
    rotary = LlamaRotaryEmbedding(LlamaConfig(hidden_size=Hq * D, num_attention_heads=Hq, num_key_value_heads=Hk,
                                              rope_theta=100000.0))
    cos, sin = rotary(q[None], torch.randint(0, 2000, (1, T)))
    q_ref, k_ref = apply_rotary_pos_emb(q.view(1, T, Hq, D).transpose(1, 2), k.view(1, T, Hk, D).transpose(1, 2),
                                        cos, sin)
    q2, k2 = q.clone().view(T, Hq, D), k.clone().view(T, Hk, D)
    ext.rotary_embedding_(q2, k2, cos[0].contiguous(), sin[0].contiguous())
    assert torch.equal(q2, q_ref[0].transpose(0, 1)) and torch.equal(k2, k_ref[0].transpose(0, 1))

    # Within one ulp (bf16: 2**-7 relative to the power of two below, so up to 2**-6 of the value).
    gate, up = (torch.randn(T, 1536) * 3).to(dtype), torch.randn(T, 1536).to(dtype)
    ref = torch.nn.functional.silu(gate) * up
    out = ext.silu_and_mul(gate, up)
    torch.testing.assert_close(out, ref, rtol=1e-5 if dtype == torch.float32 else 2 ** -6, atol=1e-5)
    if dtype == torch.bfloat16:
        assert (out == ref).float().mean() > 0.99

    x, residual = torch.randn(T, 576).to(dtype), torch.randn(T, 576).to(dtype)
    norm = LlamaRMSNorm(576, eps=1e-5).to(dtype)
    torch.nn.init.normal_(norm.weight, 1.0, 0.3)
    total, normed = ext.add_rms_norm(x, residual, norm.weight, norm.variance_epsilon)
    assert torch.equal(total, residual + x)
    torch.testing.assert_close(normed, norm(residual + x), rtol=1e-5 if dtype == torch.float32 else 2 ** -6, atol=1e-5)
    assert not normed.isnan().any()



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [1, 20, 37, 50])
def test_layer_ops_at_widths_off_the_vector_lanes(ext, dtype, width):
    """Rows whose width is not a multiple of the 16 vector lanes (the AVX-512 row ops' masked tails): RoPE exact (a
    lane written past a half would show in the other half or the next head), silu * mul and add + RMSNorm within an
    ulp of torch's ops."""
    torch.manual_seed(width)
    T, H = 7, 3
    d = 2 * width  # RoPE's half: width
    x = torch.randn(T, H, d).to(dtype)
    cos, sin = torch.randn(T, d).to(dtype), torch.randn(T, d).to(dtype)
    x1, x2 = x[..., :width], x[..., width:]
    rotate_half = torch.cat((-x2, x1), dim=-1)
    ref = x * cos[:, None] + rotate_half * sin[:, None]  # transformers' apply_rotary_pos_emb, dtype ops
    got = x.clone()
    ext.rotary_embedding_(got, torch.zeros(T, 0, d, dtype=dtype), cos, sin)
    assert torch.equal(got, ref)

    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2 ** -6, atol=1e-5)
    gate_up = (torch.randn(T, 2 * width + 16) * 3).to(dtype)  # a strided view, a row's end followed by more
    gate, up = gate_up[:, :width], gate_up[:, width : 2 * width]
    out = ext.silu_and_mul(gate, up)
    torch.testing.assert_close(out, torch.nn.functional.silu(gate) * up, **tol)

    a, b, w = torch.randn(T, width).to(dtype), torch.randn(T, width).to(dtype), torch.randn(width).to(dtype)
    total, normed = ext.add_rms_norm(a, b, w, 1e-6)
    assert torch.equal(total, a + b)
    s = total.float()
    want = w * (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    torch.testing.assert_close(normed, want, **tol)
    want = w * (a.float() * torch.rsqrt(a.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    torch.testing.assert_close(ext.rms_norm(a, w, 1e-6), want, **tol)

"""The fused CPU RMSNorm against transformers' own module, and its installation on the engine's model."""

from __future__ import annotations

import pytest
import torch

from pagedcore import fused_norms



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_fused_rmsnorm_matches_transformers(ext, dtype, rows):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(rows)
    norm = LlamaRMSNorm(576, eps=1e-5).to(dtype)
    torch.nn.init.normal_(norm.weight, 1.0, 0.3)
    x = (torch.randn(2, rows, 576) * 4).to(dtype)
    ref = norm(x)
    fused_norms.install(torch.nn.Sequential(norm), torch.device("cpu"))
    out = norm(x)
    assert out.dtype == dtype and out.shape == x.shape and not out.isnan().any()
    # Rounded to the model dtype at the same places as transformers; only the fp32 sum of squares runs
    # in another order, which can move a value across a rounding boundary: within about an ulp.
    tol = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    if dtype != torch.float32:
        assert (out == ref).float().mean() > 0.99  # nearly every element is bit-equal


def test_fused_rmsnorm_falls_back_on_mixed_dtypes(ext):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(64)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    ref = norm(x)
    assert fused_norms.install(norm, torch.device("cpu")) == 1
    assert torch.equal(norm(x), ref)  # fp32 weight, bf16 input: transformers' own forward runs


def test_engine_model_gets_fused_norms(ext, tiny_model_dir):
    from pagedcore import LLMEngine

    engine = LLMEngine(model=str(tiny_model_dir("llama")), num_kv_blocks=16)
    norms = [m for m in engine.model.modules() if type(m).__name__ == "LlamaRMSNorm"]
    assert norms and all("_fused_rmsnorm" in m.forward.__qualname__ for m in norms)

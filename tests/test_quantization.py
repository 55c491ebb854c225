"""Weight-only int4 linears (quantization="int4"): the kernel against a dequantized reference, the
Q4_1 grid recovered exactly, and the engine end to end."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pagedcore import LLM, SamplingParams
from pagedcore.quantization import GROUP_SIZE, Int4Linear, quantize_int4


def q4_1_weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """A weight on a Q4_1 grid, as the bundled GGUF stores it: per 32 values w = q * d + m, q = 0 and 15 used."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k // GROUP_SIZE, GROUP_SIZE), generator=g)
    q[..., 0], q[..., 1] = 0, 15
    d = torch.rand(n, k // GROUP_SIZE, 1, generator=g) * 0.02 + 1e-3
    m = torch.randn(n, k // GROUP_SIZE, 1, generator=g) * 0.05
    return (q * d + m).view(n, k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_int4_linear_reproduces_q4_1_weights(dtype, rows):
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

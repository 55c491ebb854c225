"""int4 groups of 64/128 and a tied input embedding read from the int4 LM head (`Int4Linear.rows`): rows equal
the weight the kernel multiplies, and the engine's greedy output equals transformers' on the de-quantized
model (fp32 activations, so the comparison is exact up to fp32 sums)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conftest import assert_greedy_equal, hf_greedy, tiny_config
from pagedcore import LLM, EngineConfig, SamplingParams, quantization
from pagedcore.quantization import Int4Linear, quantize_int4


def kernel_weight(layer: Int4Linear) -> torch.Tensor:
    """[N, K]: the weight as the kernel multiplies it, read back through one-hot inputs (fp32 activations)."""
    return layer(torch.eye(layer.in_features)).T


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("kind", ["min", "min_fp32", "zero_point"])
def test_rows_equal_the_weight_the_kernel_multiplies(group_size, kind, monkeypatch):
    monkeypatch.setattr(quantization, "INT8_ACTIVATION_ROWS", 0)
    torch.manual_seed(group_size)
    n, k = 48, 256
    if kind == "zero_point":  # GPTQ-style (q - z) * s, fp16 scale and zero point
        q = torch.randint(0, 16, (n, k))
        scale = (torch.rand(n, k // group_size) * 0.02 + 1e-3).half().float()
        zero = torch.randint(0, 16, (n, k // group_size)).float()
        layer = Int4Linear.from_zero_points(q, scale, zero, None, torch.float32, group_size)
        assert layer.zero_point
    else:
        linear = nn.Linear(k, n, bias=False)
        if kind == "min_fp32":  # weights past fp16's range keep fp32 scale/min panels
            linear.weight.data[0] *= 1e9
        layer = Int4Linear(linear, torch.float32, group_size)
        assert layer.scales_and_zeros.dtype == (torch.float32 if kind == "min_fp32" else torch.float16)
    want = kernel_weight(layer)
    torch.testing.assert_close(layer.rows(torch.arange(n)), want, rtol=1e-6, atol=1e-7)
    ids = torch.tensor([[3, 17, 47], [0, 8, 16]])  # any shape, both nibbles of a byte, several panels
    torch.testing.assert_close(layer.rows(ids), want[ids], rtol=1e-6, atol=1e-7)


def tied_llama_dir(tmp_path, smollm2_tokenizer) -> str:
    from transformers import AutoModelForCausalLM

    config = tiny_config("llama")
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(tmp_path)
    smollm2_tokenizer.save_pretrained(tmp_path)
    return str(tmp_path)


def dequantized_reference(model_dir: str, engine_model: nn.Module) -> nn.Module:
    """transformers' model with every weight the engine quantized replaced by its de-quantized values
    (the tied embedding with them, through the shared Parameter)."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        for name, module in engine_model.named_modules():
            if isinstance(module, Int4Linear):
                ref.get_submodule(name).weight.copy_(module.rows(torch.arange(module.out_features)))
    return ref


@pytest.mark.parametrize("group_size", [32, 64])
def test_engine_embeds_from_the_int4_head(group_size, tmp_path, smollm2_tokenizer, monkeypatch):
    monkeypatch.setattr(quantization, "INT8_ACTIVATION_ROWS", 0)
    model_dir = tied_llama_dir(tmp_path, smollm2_tokenizer)
    llm = LLM(model_dir, dtype="float32", quantization="int4", quantization_group_size=group_size,
              num_kv_blocks=64)
    model = llm.engine.model
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    assert isinstance(head, Int4Linear) and head.group_size == group_size
    assert embedding.weight.numel() == 0, "the 16-bit table must be gone: one copy, in the head"
    ids = torch.tensor([[5, 900, 49151]])
    assert torch.equal(embedding(ids), head.rows(ids))

    ref = dequantized_reference(model_dir, model)
    prompts = [[5, 6, 7, 8, 9], list(range(300, 340))]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=5)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        ref_tokens, ref_logprobs = hf_greedy(ref, prompt, 10)
        got = out.outputs[0]
        assert_greedy_equal(got.token_ids, got.logprobs, ref_tokens, ref_logprobs)
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def test_group_size_is_checked():
    with pytest.raises(ValueError, match="quantization_group_size must be 32, 64 or 128"):
        EngineConfig(quantization="int4", quantization_group_size=48)
    with pytest.raises(ValueError, match="int4 group size 16; supported: 32, 64, 128"):
        quantize_int4(nn.Sequential(nn.Linear(64, 32)), torch.device("cpu"), group_size=16)


def test_widths_the_group_does_not_divide_stay_16_bit():
    model = nn.Sequential(nn.Linear(576, 64), nn.Linear(1536, 64))
    assert quantize_int4(model, torch.device("cpu"), group_size=128) == 1  # 576 = 4.5 x 128
    assert [type(m).__name__ for m in model] == ["Linear", "Int4Linear"]

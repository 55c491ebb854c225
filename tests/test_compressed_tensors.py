"""compressed-tensors W4A16 checkpoints, made here with compressed-tensors itself (round-to-nearest
scales), served quantized (Int4Linear over the checkpoint's own codes) and checked against the
format's own de-quantization: transformers' compressed-tensors loader, and compressed-tensors'
unpack + dequantize where transformers cannot load the checkpoint (zero points)."""

import json

import pytest
import torch

pytest.importorskip("compressed_tensors")

from conftest import hf_greedy, tiny_config  # noqa: E402
from pagedcore import LLM, SamplingParams  # noqa: E402
from pagedcore import compressed_tensors as ct  # noqa: E402
from pagedcore.quantization import Int4Linear  # noqa: E402


def make_checkpoint(path, tokenizer, group_size=32, symmetric=True, num_bits=4, strategy="group", model=None):
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 apply_quantization_config)
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = model or AutoModelForCausalLM.from_config(tiny_config("llama"), dtype=torch.float32)
    if strategy == "channel":
        group_size = None
    args = QuantizationArgs(num_bits=num_bits, type="int", symmetric=symmetric, strategy=strategy, group_size=group_size)
    apply_quantization_config(model, QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)}, ignore=["lm_head"],
        format="pack-quantized"))
    qmax = 2 ** (num_bits - 1)
    for m in model.modules():
        if hasattr(m, "weight_scale"):  # round-to-nearest scales, as a min/max observer would set them
            w = m.weight.data.view(m.weight.shape[0], -1, group_size or m.weight.shape[1])
            if symmetric:
                scale, zp = w.abs().amax(-1) / (qmax - 0.5), torch.zeros(w.shape[:2])
            else:
                lo, hi = w.amin(-1).clamp(max=0), w.amax(-1).clamp(min=0)
                scale = (hi - lo) / (2 * qmax - 1)
                zp = (-qmax - lo / scale).round().clamp(-qmax, qmax - 1)
            m.weight_scale.data.copy_(scale)
            m.weight_zero_point.data.copy_(zp.to(m.weight_zero_point.dtype))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="pack-quantized")
    compressor.compress_model(model)
    model.save_pretrained(path)
    compressor.update_config(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def w4(tmp_path_factory, smollm2_tokenizer):
    return {g: make_checkpoint(tmp_path_factory.mktemp(f"w4g{g}"), smollm2_tokenizer, group_size=g) for g in (32, 64)}


@pytest.mark.parametrize("group_size", [32, 64])
def test_w4a16_logits_equal_transformers_decompression(w4, group_size):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(str(w4[group_size]), dtype=torch.float32)
    ours = ct.load(w4[group_size], torch.float32)
    linears = [m for m in ours.modules() if isinstance(m, Int4Linear)]
    assert len(linears) == 14 and all(m.group_size == group_size for m in linears)
    ids = torch.tensor([[1, 500, 600, 700, 42, 9000, 31]])
    with torch.no_grad():
        a, b = ref(ids).logits, ours(ids).logits
    assert torch.isfinite(b).all()
    torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)


def test_engine_serves_the_checkpoint_quantized_with_greedy_equal_to_transformers(w4):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(str(w4[32]), dtype=torch.float32)
    llm = LLM(str(w4[32]), num_kv_blocks=64, block_size=8)
    assert sum(isinstance(m, Int4Linear) for m in llm.engine.model.modules()) == 14
    prompts = [[1, 500, 600, 700], [9, 8, 7, 6, 5, 4, 3, 2, 1, 42]]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(ref, p, 12)[0]
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def test_zero_points_match_compressed_tensors_own_dequantization(tmp_path, smollm2_tokenizer):
    from compressed_tensors.compressors import unpack_from_int32
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize
    from safetensors.torch import load_file

    path = make_checkpoint(tmp_path / "asym", smollm2_tokenizer, symmetric=False)
    state = load_file(str(path / "model.safetensors"))
    name = "model.layers.1.mlp.down_proj"
    n, k = (int(v) for v in state[f"{name}.weight_shape"])
    q = unpack_from_int32(state[f"{name}.weight_packed"], 4, torch.Size([n, k]))
    zp = unpack_from_int32(state[f"{name}.weight_zero_point"], 4, torch.Size([n, k // 32]), packed_dim=0)
    args = QuantizationArgs(num_bits=4, type="int", symmetric=False, strategy="group", group_size=32)
    expected = dequantize(q, state[f"{name}.weight_scale"], zp, args=args)
    assert zp.abs().sum() > 0, "the checkpoint must really carry zero points"
    ours = ct.load(path, torch.float32).get_submodule(name)
    eye = torch.eye(k)
    got = ours(eye).t()  # column j of W: the layer applied to the j-th unit vector
    torch.testing.assert_close(got, expected.float(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("strategy", ["channel", "group"])
def test_w8a16_logits_equal_transformers_decompression(tmp_path, smollm2_tokenizer, strategy):
    from transformers import AutoModelForCausalLM

    from pagedcore.quantization import Int8Linear

    path = make_checkpoint(tmp_path, smollm2_tokenizer, num_bits=8, strategy=strategy)
    ref = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    ours = ct.load(path, torch.float32)
    linears = [m for m in ours.modules() if isinstance(m, Int8Linear)]
    assert len(linears) == 14 and all(m.group_size == (None if strategy == "channel" else 32) for m in linears)
    ids = torch.tensor([[1, 500, 600, 700, 42, 9000, 31]])
    with torch.no_grad():
        a, b = ref(ids).logits, ours(ids).logits
    assert torch.isfinite(b).all() and a.abs().max() > 1
    torch.testing.assert_close(b, a, atol=1e-4 * a.abs().max().item(), rtol=1e-4)
    llm = LLM(str(path), num_kv_blocks=64, block_size=8)
    out = llm.generate([[1, 500, 600, 700]], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    assert out[0].outputs[0].token_ids == hf_greedy(ref, [1, 500, 600, 700], 12)[0]


def test_unsupported_schemes_are_refused_naming_what_is_supported(tmp_path, smollm2_tokenizer):
    path = make_checkpoint(tmp_path / "w8", smollm2_tokenizer, num_bits=8, symmetric=False)
    with pytest.raises(ValueError, match="8-bit int weights.*supported: compressed-tensors pack-quantized int4"):
        LLM(str(path), num_kv_blocks=16)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["input_activations"] = {"num_bits": 8, "type": "int"}
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="quantized activations"):
        ct.weight_args(ct.quantization_config(path))

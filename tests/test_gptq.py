"""GPTQ checkpoints (AutoGPTQ / gptqmodel layout), made here by round-to-nearest from a tiny random Llama,
served quantized (Int4Linear over the checkpoint's own codes) and checked against the format's own
de-quantization, written here from the documented math: w = scales[g_idx] * (q - zeros[g_idx]), v1
zeros stored minus one (AutoGPTQ reads (stored + 1) & 15). gptqmodel itself does not install on a
CPU-only machine (a CUDA source build), so the reference is that formula, not the library."""

import json

import pytest
import torch

from conftest import hf_greedy
from pagedcore import LLM, SamplingParams
from pagedcore import gptq
from pagedcore.quantization import Int4Linear
from quantized_models import PROMPTS, dense_reference, linear_names, pack_nibbles, save_checkpoint, tiny_llama, \
    unpack_nibbles


def quantize(w: torch.Tensor, group_size: int, sym: bool, desc_act: bool, gen: torch.Generator, v1: bool = True):
    """One linear's GPTQ tensors by round-to-nearest (GPTQ's quantizer without its error feedback)."""
    n, k = w.shape
    g = k if group_size == -1 else group_size
    order = torch.randperm(k, generator=gen) if desc_act else torch.arange(k)  # act-order: groups scattered
    g_idx = torch.empty(k, dtype=torch.long)
    g_idx[order] = torch.arange(k) // g
    wt = w.t()  # [K, N], GPTQ's orientation
    scales, zeros = torch.empty(k // g, n), torch.empty(k // g, n)
    for j in range(k // g):
        rows = wt[g_idx == j]
        if sym:
            scale, zero = 2 * rows.abs().amax(0) / 15, torch.full((n,), 8.0)
        else:
            lo, hi = rows.amin(0).clamp(max=0), rows.amax(0).clamp(min=0)
            scale = (hi - lo) / 15
            zero = (-lo / scale).round()
        scales[j], zeros[j] = scale.half().float(), zero
    q = (wt / scales[g_idx]).round().add(zeros[g_idx]).clamp(0, 15)
    stored = (zeros.long() - 1) & 0xF if v1 else zeros.long()  # v1: zero - 1
    return {"qweight": pack_nibbles(q, 0), "qzeros": pack_nibbles(stored, 1),
            "scales": scales.half(), "g_idx": g_idx.to(torch.int32)}


def dequantize(t: dict[str, torch.Tensor], v1: bool = True) -> torch.Tensor:
    """AutoGPTQ's own formula on the stored tensors -> w [N, K]."""
    q = unpack_nibbles(t["qweight"], 0)  # [K, N]
    zeros = unpack_nibbles(t["qzeros"], 1)
    if v1:
        zeros = (zeros + 1) & 0xF
    g = t["g_idx"].long()
    return (t["scales"].float()[g] * (q - zeros[g])).t()


def make_checkpoint(path, tokenizer, group_size=32, sym=True, desc_act=False, bits=4, fmt="gptq", model=None):
    model = model or tiny_llama()
    gen = torch.Generator().manual_seed(1)
    tensors, weights = {}, {}
    for name in linear_names(model):
        t = quantize(model.get_submodule(name).weight.detach(), group_size, sym, desc_act, gen, fmt == "gptq")
        tensors.update({f"{name}.{k}": v for k, v in t.items()})
        weights[name] = dequantize(t, fmt == "gptq")
    cfg = {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": desc_act, "sym": sym,
           "damp_percent": 0.01, "true_sequential": True, "static_groups": False, "checkpoint_format": fmt}
    save_checkpoint(path, model, tensors, cfg, tokenizer)
    return path, dense_reference(model, weights)


CASES = [(32, True, False), (64, False, False), (128, True, True), (32, False, True), (-1, False, False)]


@pytest.mark.parametrize("group_size,sym,desc_act", CASES)
def test_logits_equal_the_formats_own_dequantization(tmp_path, smollm2_tokenizer, group_size, sym, desc_act):
    path, ref = make_checkpoint(tmp_path, smollm2_tokenizer, group_size, sym, desc_act)
    ours = gptq.load(path, torch.float32)
    linears = [m for m in ours.modules() if isinstance(m, Int4Linear)]
    assert len(linears) == 14
    assert all(m.group_size == (128 if group_size == -1 and m.in_features == 128 else
                                256 if group_size == -1 else group_size) for m in linears)
    # act-order permutes the inputs where there is more than one group
    assert all((m.input_perm is not None) == (desc_act and m.in_features > m.group_size) for m in linears)
    ids = torch.tensor(PROMPTS[:1])
    with torch.no_grad():
        a, b = ref(ids).logits, ours(ids).logits
    assert torch.isfinite(b).all() and a.abs().max() > 1
    torch.testing.assert_close(b, a, atol=1e-4 * a.abs().max().item(), rtol=1e-4)


def test_v2_format_zeros_are_read_as_stored(tmp_path, smollm2_tokenizer):
    path, ref = make_checkpoint(tmp_path, smollm2_tokenizer, 32, sym=False, fmt="gptq_v2")
    ids = torch.tensor(PROMPTS[:1])
    with torch.no_grad():
        a, b = ref(ids).logits, gptq.load(path, torch.float32)(ids).logits
    torch.testing.assert_close(b, a, atol=1e-4 * a.abs().max().item(), rtol=1e-4)


def test_act_order_layer_equals_its_dequantized_weight(tmp_path, smollm2_tokenizer):
    path, ref = make_checkpoint(tmp_path, smollm2_tokenizer, 32, sym=False, desc_act=True)
    name = "model.layers.1.mlp.down_proj"
    layer = gptq.load(path, torch.float32).get_submodule(name)
    got = layer(torch.eye(layer.in_features)).t()  # column j of W: the layer applied to the j-th unit vector
    torch.testing.assert_close(got, ref.get_submodule(name).weight, atol=1e-6, rtol=1e-5)


def test_engine_greedy_equals_transformers_on_the_dequantized_model(tmp_path, smollm2_tokenizer):
    path, ref = make_checkpoint(tmp_path, smollm2_tokenizer, 64, sym=False, desc_act=True)
    llm = LLM(str(path), num_kv_blocks=64, block_size=8)
    assert sum(isinstance(m, Int4Linear) for m in llm.engine.model.modules()) == 14
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    for p, o in zip(PROMPTS, outs):
        assert o.outputs[0].token_ids == hf_greedy(ref, p, 12)[0]
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


@pytest.mark.parametrize("change,message", [
    ({"bits": 8}, "8-bit weights"),
    ({"bits": 3}, "3-bit weights"),
    ({"checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
    ({"dynamic": {"-:.*down_proj": {}}}, "dynamic"),
])
def test_unsupported_settings_are_refused_naming_what_is_supported(tmp_path, smollm2_tokenizer, change, message):
    path, _ = make_checkpoint(tmp_path, smollm2_tokenizer)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"].update(change)
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=f"{message}.*supported: GPTQ 4-bit"):
        LLM(str(path), num_kv_blocks=16)


def test_tensors_that_do_not_fit_the_group_size_are_refused(tmp_path, smollm2_tokenizer):
    path, _ = make_checkpoint(tmp_path, smollm2_tokenizer, group_size=64)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"]["group_size"] = 32
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="do not fit 4-bit GPTQ with group_size 32"):
        gptq.load(path, torch.float32)

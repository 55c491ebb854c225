"""AWQ (GEMM) checkpoints, made here by round-to-nearest from a tiny random Llama in AutoAWQ's packing,
served quantized (Int4Linear over the checkpoint's own codes) and checked against the format's own
de-quantization written here from AutoAWQ's documented math: unpack with shifts, undo the interleave
[0, 2, 4, 6, 1, 3, 5, 7], w = (q - zeros) * scales. AutoAWQ itself needs CUDA to install."""

import json

import pytest
import torch

from conftest import hf_greedy
from pagedcore import LLM, SamplingParams
from pagedcore import awq
from pagedcore.quantization import Int4Linear
from quantized_models import PROMPTS, dense_reference, linear_names, pack_nibbles, save_checkpoint, tiny_llama, \
    unpack_nibbles

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ's pack: nibble i of each int32 takes column AWQ_ORDER[i]
AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]  # and its unpack: column j comes from nibble AWQ_REVERSE_ORDER[j]


def pack_awq(codes: torch.Tensor) -> torch.Tensor:
    """[R, C] codes -> [R, C/8] int32, as AutoAWQ's WQLinear_GEMM.from_linear packs them."""
    r, c = codes.shape
    interleaved = codes.view(r, c // 8, 8)[:, :, AWQ_ORDER].reshape(r, c)
    return pack_nibbles(interleaved.t(), 0).t()  # nibble i of int32 [r, j] = interleaved[r, 8j + i]


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    r, c8 = packed.shape
    nibbles = unpack_nibbles(packed.t(), 0).t()  # [R, C] in nibble order
    return nibbles.view(r, c8, 8)[:, :, AWQ_REVERSE_ORDER].reshape(r, c8 * 8)


def quantize(w: torch.Tensor, group_size: int):
    """AutoAWQ's pseudo-quantizer (zero point, min/max per group of inputs), without its scale search."""
    n, k = w.shape
    wg = w.view(n, k // group_size, group_size)
    lo, hi = wg.amin(-1), wg.amax(-1)
    scales = ((hi - lo).clamp(min=1e-5) / 15).half().float()  # [N, K/g]
    zeros = (-lo / scales).round().clamp(0, 15)
    q = (wg / scales[..., None]).round().add(zeros[..., None]).clamp(0, 15).view(n, k)
    return {"qweight": pack_awq(q.t().long()), "qzeros": pack_awq(zeros.t().long()), "scales": scales.t().half()}


def dequantize(t: dict[str, torch.Tensor], group_size: int) -> torch.Tensor:
    q, zeros = unpack_awq(t["qweight"]), unpack_awq(t["qzeros"])  # [K, N], [K/g, N]
    w = (q - zeros.repeat_interleave(group_size, 0)) * t["scales"].float().repeat_interleave(group_size, 0)
    return w.t()


def make_checkpoint(path, tokenizer, group_size=32, version="gemm", bits=4, model=None):
    model = model or tiny_llama()
    tensors, weights = {}, {}
    for name in linear_names(model):
        t = quantize(model.get_submodule(name).weight.detach(), group_size)
        tensors.update({f"{name}.{k}": v for k, v in t.items()})
        weights[name] = dequantize(t, group_size)
    cfg = {"quant_method": "awq", "bits": bits, "group_size": group_size, "zero_point": True, "version": version,
           "modules_to_not_convert": None}
    save_checkpoint(path, model, tensors, cfg, tokenizer)
    return path, dense_reference(model, weights)


def test_pack_and_unpack_follow_autoawqs_interleave():
    codes = torch.arange(16).repeat(3, 1) % 16  # [3, 16]
    packed = pack_awq(codes)
    # the first int32 of a row: columns 0, 2, 4, 6, 1, 3, 5, 7 in nibbles 0..7
    assert packed[0, 0].item() & 0xFFFFFFFF == sum(c << (4 * i) for i, c in enumerate(AWQ_ORDER))
    assert torch.equal(unpack_awq(packed), codes)
    assert torch.equal(awq.unpack_awq(packed).long(), codes)


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_logits_equal_the_formats_own_dequantization(tmp_path, smollm2_tokenizer, group_size):
    path, ref = make_checkpoint(tmp_path, smollm2_tokenizer, group_size)
    ours = awq.load(path, torch.float32)
    linears = [m for m in ours.modules() if isinstance(m, Int4Linear)]
    assert len(linears) == 14 and all(m.group_size == group_size for m in linears)
    ids = torch.tensor(PROMPTS[:1])
    with torch.no_grad():
        a, b = ref(ids).logits, ours(ids).logits
    assert torch.isfinite(b).all() and a.abs().max() > 1
    torch.testing.assert_close(b, a, atol=1e-4 * a.abs().max().item(), rtol=1e-4)


def test_engine_greedy_equals_transformers_on_the_dequantized_model(tmp_path, smollm2_tokenizer):
    path, ref = make_checkpoint(tmp_path, smollm2_tokenizer, 64)
    llm = LLM(str(path), num_kv_blocks=64, block_size=8)
    assert sum(isinstance(m, Int4Linear) for m in llm.engine.model.modules()) == 14
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    for p, o in zip(PROMPTS, outs):
        assert o.outputs[0].token_ids == hf_greedy(ref, p, 12)[0]
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


@pytest.mark.parametrize("change,message", [
    ({"version": "gemv"}, "version 'gemv'"),
    ({"version": "exllama"}, "version 'exllama'"),
    ({"bits": 8}, "8-bit weights"),
    ({"zero_point": False}, "zero_point false"),
])
def test_unsupported_settings_are_refused_naming_what_is_supported(tmp_path, smollm2_tokenizer, change, message):
    path, _ = make_checkpoint(tmp_path, smollm2_tokenizer)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"].update(change)
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=f"{message}.*supported: AWQ 4-bit"):
        LLM(str(path), num_kv_blocks=16)


def test_an_unknown_quant_method_is_refused_naming_the_supported_ones(tmp_path, smollm2_tokenizer):
    path, _ = make_checkpoint(tmp_path, smollm2_tokenizer)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"]["quant_method"] = "bitsandbytes"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="'bitsandbytes' is not supported.*gptq: GPTQ 4-bit.*awq: AWQ 4-bit"):
        LLM(str(path), num_kv_blocks=16)

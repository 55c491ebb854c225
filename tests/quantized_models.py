"""Helpers for the pre-quantized checkpoint tests: a tiny random Llama, its linears quantized by
round-to-nearest into a format's tensors (written by each test from the format's documented layout),
and the dense reference holding the format's own de-quantization of those tensors."""

from __future__ import annotations

import json

import torch

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
PROMPTS = [[1, 500, 600, 700, 42, 9000, 31], [9, 8, 7, 6, 5, 4, 3, 2, 1, 42]]


def tiny_llama(hidden: int = 128, vocab_size: int = 49152):
    """Input widths 128 and 256, so that groups of 32, 64 and 128 all divide them."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab_size,
                                  max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=2,
                                  initializer_range=0.3, tie_word_embeddings=False)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def linear_names(model) -> list[str]:
    return [f"model.layers.{i}.{n}" for i in range(model.config.num_hidden_layers) for n in LINEARS]


def save_checkpoint(path, model, tensors: dict[str, torch.Tensor], quantization_config: dict, tokenizer):
    """config.json with `quantization_config`, one safetensors file: the quantized linears' `tensors`
    in place of their weights, every other weight as it is."""
    from safetensors.torch import save_file

    quantized = set(linear_names(model))
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k.rsplit(".", 1)[0] not in quantized}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # the embedding, stored once (safetensors refuses shared tensors)
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    save_file({**state, **tensors}, str(path / "model.safetensors"), metadata={"format": "pt"})
    model.config.save_pretrained(path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = quantization_config
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    tokenizer.save_pretrained(path)
    return path


def dense_reference(model, weights: dict[str, torch.Tensor]):
    """A copy of `model` (transformers' own, dense) whose linears hold the de-quantized `weights` [N, K]."""
    import copy

    ref = copy.deepcopy(model)
    with torch.no_grad():
        for name, w in weights.items():
            ref.get_submodule(name).weight.copy_(w)
    return ref.eval()


def pack_nibbles(codes: torch.Tensor, dim: int) -> torch.Tensor:
    """Eight 4-bit codes per int32 along `dim`, the i-th of each eight at bits 4i..4i+3."""
    codes = codes.long().movedim(dim, 0)
    out = torch.zeros((codes.shape[0] // 8, *codes.shape[1:]), dtype=torch.long)
    for i in range(8):
        out |= codes[i::8] << (4 * i)
    out = torch.where(out >= 2**31, out - 2**32, out)  # two's complement: the int32 bit pattern
    return out.to(torch.int32).movedim(0, dim).contiguous()


def unpack_nibbles(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """The inverse of pack_nibbles, by shifts (the reference reads the checkpoint its own way)."""
    p = packed.long().movedim(dim, 0) & 0xFFFFFFFF
    out = torch.stack([(p >> (4 * i)) & 0xF for i in range(8)], 1)  # [R, 8, ...]
    return out.reshape(-1, *p.shape[1:]).movedim(0, dim)

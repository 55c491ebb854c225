"""compressed-tensors checkpoints (as llmcompressor writes them), loaded without de-quantizing.

Supported: `pack-quantized` int weights, activations unquantized:
- W4A16: 4 bits, `group` strategy (any group size dividing the input width, even), symmetric or with
  zero points. Each such linear becomes an `Int4Linear` holding the checkpoint's own codes:
  compressed-tensors stores q + 8 for q in [-8, 7] (8 per int32, element i at bits 4i..4i+3) and means
  w = (q - zero_point) * scale, which is our kernel's w = u * scale + lo with u = q + 8 and
  lo = -(8 + zero_point) * scale, exactly.
- W8A16: 8 bits, symmetric, `channel` or `group` strategy: q + 128 stored 4 per int32 (element i at
  bits 8i..8i+7), w = q * scale: an `Int8Linear` over q (per channel: torch's int8 kernel).
Anything else is refused with a message naming what is supported.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

SUPPORTED = ("compressed-tensors pack-quantized int4 weights with group strategy (W4A16, symmetric or zero points) "
             "and int8 weights, symmetric, with channel or group strategy (W8A16)")


def quantization_config(model_dir: Path) -> dict | None:
    cfg = json.loads((model_dir / "config.json").read_text()).get("quantization_config")
    return cfg if cfg and cfg.get("quant_method") == "compressed-tensors" else None


def weight_args(cfg: dict) -> dict:
    """The one weight scheme of the checkpoint, checked against what the kernel can run."""
    groups = list(cfg.get("config_groups", {}).values())
    if len(groups) != 1:
        raise ValueError(f"{len(groups)} quantization config groups; supported: one ({SUPPORTED})")
    g = groups[0]
    w, fmt = g.get("weights") or {}, g.get("format") or cfg.get("format")
    bits, strategy = w.get("num_bits"), w.get("strategy")
    checks = [(fmt == "pack-quantized", f"format {fmt!r}"),
              (bits in (4, 8) and w.get("type") == "int", f"{bits}-bit {w.get('type')} weights"),
              (strategy == "group" or (bits, strategy) == (8, "channel"), f"strategy {strategy!r} for {bits}-bit"),
              (bits != 8 or w.get("symmetric", True), "8-bit int weights with zero points"),
              (not g.get("input_activations"), "quantized activations")]
    problems = [what for ok, what in checks if not ok]
    if problems:
        raise ValueError(f"unsupported compressed-tensors checkpoint ({', '.join(problems)}); supported: {SUPPORTED}")
    return {**w, "targets": g.get("targets", [])}


def unpack_int4(packed: torch.Tensor, num_columns: int) -> torch.Tensor:
    """[N, K/8] int32 -> [N, K] uint8 codes (q + 8), element i at bits 4i..4i+3 (little-endian)."""
    b = packed.contiguous().view(torch.uint8)  # x86 is little-endian: byte j holds elements 2j, 2j+1
    return torch.stack([b & 0xF, b >> 4], -1).reshape(packed.shape[0], -1)[:, :num_columns]


def int4_linear(tensors: dict[str, torch.Tensor], bias: torch.Tensor | None, dtype: torch.dtype, group_size: int):
    from pagedcore.quantization import Int4Linear

    n, k = (int(v) for v in tensors["weight_shape"])
    u = unpack_int4(tensors["weight_packed"], k)
    scale = tensors["weight_scale"].float()
    zp = tensors.get("weight_zero_point")
    if zp is None:
        zp = torch.zeros_like(scale)
    else:  # zero points are packed along the output dimension
        zp = unpack_int4(zp.t().contiguous(), n).t().float() - 8
    return Int4Linear.from_zero_points(u, scale, 8 + zp, bias, dtype, group_size)


def int8_linear(tensors: dict[str, torch.Tensor], bias: torch.Tensor | None, dtype: torch.dtype,
                group_size: int | None):
    from pagedcore.quantization import Int8Linear

    n, k = (int(v) for v in tensors["weight_shape"])
    u = tensors["weight_packed"].contiguous().view(torch.uint8)[:, :k]  # little-endian: byte i is element i
    q = (u.to(torch.int16) - 128).to(torch.int8)
    return Int8Linear(q, tensors["weight_scale"].float(), bias, dtype, group_size)


def load(model_dir: Path, dtype: torch.dtype):
    """The HF model with every quantized linear as an Int4Linear / Int8Linear over the checkpoint's codes."""
    from pagedcore import quantized_checkpoint

    args = weight_args(quantization_config(model_dir))

    def build(name: str, parts: dict[str, torch.Tensor]) -> nn.Module:
        if args["num_bits"] == 8:
            return int8_linear(parts, parts.get("bias"), dtype, args.get("group_size"))
        return int4_linear(parts, parts.get("bias"), dtype, args["group_size"])

    return quantized_checkpoint.load(model_dir, dtype, "weight_packed", build, "compressed-tensors")

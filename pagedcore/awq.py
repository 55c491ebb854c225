"""AWQ checkpoints (AutoAWQ's GEMM layout, as transformers reads them), loaded without de-quantizing.

Per linear with K inputs, N outputs and groups of g:
  qweight int32 [K, N/8]   4-bit codes packed along N in AWQ's interleaved order: nibble i (bits 4i)
                           of [k, c] holds output 8c + ORDER[i], ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
  qzeros  int32 [K/g, N/8] zero points, packed the same way
  scales  fp16  [K/g, N]
and w[n, k] = (q[k, n] - zero[k // g, n]) * scales[k // g, n]: an `Int4Linear` with lo = -zero * s, exactly.
Only version "gemm" is read; "gemv" (another packing), "exllama" / "ipex" / "marlin" are refused.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from pagedcore.compressed_tensors import unpack_int4  # [R, C/8] int32 -> [R, C] in nibble order

SUPPORTED = "AWQ 4-bit weights (quant_method 'awq', version 'gemm', with zero points, group size dividing the input width)"
ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # nibble i holds output ORDER[i] of its eight
UNDO_ORDER = [ORDER.index(j) for j in range(8)]  # output j sits in nibble UNDO_ORDER[j]


def check(cfg: dict) -> int:
    """The group size, once the checkpoint's settings are checked against what the kernel runs."""
    bits = cfg.get("bits", cfg.get("w_bit"))
    version = str(cfg.get("version", "gemm")).lower()
    checks = [(bits == 4, f"{bits}-bit weights"), (version == "gemm", f"version {version!r}"),
              (cfg.get("zero_point", True), "zero_point false")]
    problems = [what for ok, what in checks if not ok]
    if problems:
        raise ValueError(f"unsupported AWQ checkpoint ({', '.join(problems)}); supported: {SUPPORTED}")
    return int(cfg.get("group_size", cfg.get("q_group_size", 128)))


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """[R, C/8] int32 in AWQ's order -> [R, C] uint8 codes in output order."""
    r, c8 = packed.shape
    return unpack_int4(packed, c8 * 8).view(r, c8, 8)[:, :, UNDO_ORDER].reshape(r, c8 * 8)


def int4_linear(name: str, parts: dict[str, torch.Tensor], dtype: torch.dtype, group_size: int):
    from pagedcore.quantization import Int4Linear

    qweight, qzeros, scales = parts["qweight"], parts.get("qzeros"), parts["scales"]
    k, n = qweight.shape[0], qweight.shape[1] * 8
    if qzeros is None or k % group_size or scales.shape != (k // group_size, n) or qzeros.shape != (k // group_size, n // 8):
        raise ValueError(f"{name}: qweight {tuple(qweight.shape)}, qzeros "
                         f"{None if qzeros is None else tuple(qzeros.shape)}, scales {tuple(scales.shape)} do not fit "
                         f"{SUPPORTED} with group_size {group_size}")
    q = unpack_awq(qweight).t()  # [N, K]
    zero = unpack_awq(qzeros).t().float()  # [N, K/g]
    scale = scales.t().float()
    return Int4Linear.from_zero_points(q, scale, zero, parts.get("bias"), dtype, group_size)


def load(model_dir: Path, dtype: torch.dtype) -> nn.Module:
    from pagedcore import quantized_checkpoint

    group_size = check(quantized_checkpoint.quantization_config(model_dir))

    def build(name: str, parts: dict[str, torch.Tensor]) -> nn.Module:
        return int4_linear(name, parts, dtype, group_size)

    return quantized_checkpoint.load(model_dir, dtype, "qweight", build, "AWQ")

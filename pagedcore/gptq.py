"""GPTQ checkpoints (AutoGPTQ / gptqmodel / transformers' layout), loaded without de-quantizing.

Per linear with K inputs, N outputs and groups of g (g = -1: one group of K):
  qweight int32 [K/8, N]   4-bit codes packed along K: input 8i+j of column n at bits 4j of [i, n]
  qzeros  int32 [K/g, N/8] zero points packed along N: output 8c+j at bits 4j of [group, c]
  scales  fp16  [K/g, N]
  g_idx   int32 [K]        the group of each input (k // g, unless act-order permuted it)
and w[n, k] = scales[g_idx[k], n] * (q[k, n] - zero[g_idx[k], n]). The v1 format
(checkpoint_format "gptq", what AutoGPTQ and gptqmodel write by default) stores zero - 1 in 4 bits, read
back as (stored + 1) & 15 as AutoGPTQ's own dequantization does; "gptq_v2" stores the zero itself.

With desc_act (act-order) g_idx is not monotone: a group's inputs are scattered over K. The kernel
needs contiguous groups, so the inputs are sorted by group once at load (a stable argsort of g_idx)
and the layer permutes x the same way in forward (`Int4Linear.input_perm`, one gather of K values
per row: small beside the matmul). Each such linear becomes an `Int4Linear` over the checkpoint's
codes: w = q * s + lo with lo = -zero * s, exactly.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from pagedcore.compressed_tensors import unpack_int4  # [R, C/8] int32 -> [R, C], element 8c+j at bits 4j

SUPPORTED = ("GPTQ 4-bit weights (quant_method 'gptq', checkpoint_format 'gptq' or 'gptq_v2', int32 packing, "
             "group_size -1 or dividing the input width, sym or not, desc_act or not)")


def check(cfg: dict) -> dict:
    """The checkpoint's settings, checked against what the kernel runs: {"v1": bool, "group_size": int}."""
    fmt = cfg.get("checkpoint_format") or cfg.get("format") or "gptq"
    checks = [(cfg.get("bits") == 4, f"{cfg.get('bits')}-bit weights"),
              (fmt in ("gptq", "gptq_v2"), f"checkpoint_format {fmt!r}"),
              (cfg.get("pack_dtype", "int32") in ("int32", "torch.int32"), f"pack_dtype {cfg.get('pack_dtype')!r}"),
              (not cfg.get("dynamic"), "per-module 'dynamic' overrides")]
    problems = [what for ok, what in checks if not ok]
    if problems:
        raise ValueError(f"unsupported GPTQ checkpoint ({', '.join(problems)}); supported: {SUPPORTED}")
    return {"v1": fmt == "gptq", "group_size": int(cfg.get("group_size", 128))}


def int4_linear(name: str, parts: dict[str, torch.Tensor], dtype: torch.dtype, v1: bool, group_size: int):
    from pagedcore.quantization import Int4Linear

    qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"]
    if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32:
        raise ValueError(f"{name}: qweight/qzeros are {qweight.dtype}/{qzeros.dtype}; supported: {SUPPORTED}")
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    g = k if group_size == -1 else group_size
    if k % g or scales.shape != (k // g, n) or qzeros.shape != (k // g, (n + 7) // 8):
        raise ValueError(f"{name}: qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)}, scales "
                         f"{tuple(scales.shape)} do not fit 4-bit GPTQ with group_size {group_size}")
    q = unpack_int4(qweight.t(), k)  # [N, K]: qweight packs along K, so unpack its transpose
    zero = unpack_int4(qzeros, n).t()  # [N, K/g]
    if v1:
        zero = (zero + 1) & 0xF
    scale = scales.t().float()
    g_idx = parts.get("g_idx")
    perm = None
    if g_idx is not None and not torch.equal(g_idx.long(), torch.arange(k) // g):
        perm = torch.argsort(g_idx.long(), stable=True)
        if not torch.equal(g_idx.long()[perm], torch.arange(k) // g):
            raise ValueError(f"{name}: g_idx does not put {g} inputs in each of {k // g} groups; supported: {SUPPORTED}")
        q = q[:, perm]
    return Int4Linear.from_zero_points(q, scale, zero, parts.get("bias"), dtype, g, input_perm=perm)


def load(model_dir: Path, dtype: torch.dtype) -> nn.Module:
    from pagedcore import quantized_checkpoint

    settings = check(quantized_checkpoint.quantization_config(model_dir))

    def build(name: str, parts: dict[str, torch.Tensor]) -> nn.Module:
        return int4_linear(name, parts, dtype, **settings)

    return quantized_checkpoint.load(model_dir, dtype, "qweight", build, "GPTQ")

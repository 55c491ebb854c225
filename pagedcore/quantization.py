"""Weight-only int4 linear layers (groups of 32, asymmetric) for the CPU, opt-in: `quantization="int4"`.
`quantization_group_size=64` (or 128) trades a little accuracy for fewer scale bytes; a tied input embedding
then reads its rows from the int4 LM head, so the whole model is 4-bit (README, "Quantized weights").

Decode at small batch reads every weight once per step, so it is bound by memory traffic: 4-bit
weights move ~3.5x fewer bytes than bf16 (this is why llama.cpp is fast on one stream). The kernel is
pagedcore's (kernels/csrc/cpu_gemm_int4.cpp: 16-column panels of nibbles), or torch's own
`_weight_int4pack_mm_for_cpu` without the C++ ops. At decode (M <= INT8_ACTIVATION_ROWS rows) it
quantizes the activations to int8 per 32 inputs and multiplies in integers, as llama.cpp does (Q8
blocks): dequantizing every weight to fp32 costs more instructions than reading it, so that path is
ALU-bound at ~2x the time. Larger M (prefill) keeps fp32 activations, dequantizing each panel once.
`PAGEDCORE_INT4_ACTIVATIONS=fp32` keeps fp32 activations at every M (exact, the A/B reference).
Checkpoints' own int4 formats (`from_codes`: GPTQ, AWQ, compressed-tensors W4A16) keep fp32 activations:
their output is defined with unquantized activations. GGUF's Q4_0 / Q4_1 take int8 activations at decode,
as llama.cpp computes them.
The bundled GGUF is Q4_1 (per 32 weights: w = q * d + m, q in 0..15, with q = 0 at the group's min
and 15 at its max, d and m fp16), so min/max re-quantization recovers its own 4-bit grid exactly; scale and
min are rounded to fp16 as Q4_1's are (1 bit per weight of scales instead of 2).
With fp32 activations results differ from the bf16 path at bf16-level precision; int8 activations add
their rounding (relative ~0.3-1% per linear), as llama.cpp's do.
"""

from __future__ import annotations

import functools
import os

import torch
from torch import nn

from pagedcore import installs
from pagedcore.kernels import cpu_ext

GROUP_SIZE = 32
GROUP_SIZES = (32, 64, 128)  # multiples of the int8 activation blocks (32) the decode path quantizes x into


def int8_activation_rows(setting: str) -> int:
    """Rows up to which activations are quantized to int8: the `PAGEDCORE_INT4_ACTIVATIONS` setting."""
    # int8: the integer path measured 1.7-4x faster than fp32 activations at M = 1..8 (AVX2 EPYC, 1 thread,
    # K=576 N=576/1536); more rows (prefill) keep fp32 activations.
    rows = {"int8": 8, "fp32": 0}
    if setting not in rows:
        raise ValueError(f"PAGEDCORE_INT4_ACTIVATIONS={setting!r}; supported: {', '.join(rows)}")
    return rows[setting]


# Read on every call, so a benchmark can switch it within one process.
INT8_ACTIVATION_ROWS = int8_activation_rows(os.environ.get("PAGEDCORE_INT4_ACTIVATIONS", "int8"))


def exactly_fp16(t: torch.Tensor) -> bool:
    """Every value of fp32 `t` is an fp16 (finite, no rounding, no underflow)."""
    half = t.half()
    return bool(half.isfinite().all()) and bool((half.float() == t).all())


def fp16_if_representable(lo: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`lo` and `scale` rounded to fp16 (then stored in half the bytes) when they stay finite; as they are
    otherwise (weights past fp16's range)."""
    # A constant group (scale at fp32's tiny) takes fp16's smallest step: its codes are 0 all the same.
    lo16, scale16 = lo.half().float(), scale.half().float().clamp(min=2.0 ** -24)
    if lo16.isfinite().all() and scale16.isfinite().all():
        return lo16, scale16
    return lo, scale


class Int4Linear(nn.Module):
    def __init__(self, linear: nn.Linear, dtype: torch.dtype, group_size: int = GROUP_SIZE):
        """Round `linear`'s weight to 4 bits per group (min/max, asymmetric)."""
        super().__init__()
        n, k = linear.weight.shape
        w = linear.weight.detach().float().view(n, k // group_size, group_size)
        lo, hi = w.amin(-1), w.amax(-1)
        scale = ((hi - lo) / 15).clamp(min=torch.finfo(torch.float32).tiny)
        lo, scale = fp16_if_representable(lo, scale)  # fp16 like GGUF's Q4_1: the codes are chosen on it
        q = ((w - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32).view(n, k)
        self._pack(q, scale, lo, linear.bias, dtype, group_size, linear.weight.device)
        self.int8_activations = True  # llama.cpp's scheme for its GGUF grid: int8 activations at decode

    @classmethod
    def from_codes(cls, q: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor, bias: torch.Tensor | None,
                   dtype: torch.dtype, group_size: int, input_perm: torch.Tensor | None = None,
                   int8_activations: bool = False) -> "Int4Linear":
        """A checkpoint's own 4-bit grid, kept exactly: w = q * scale + lo, q in 0..15 [N, K], scale
        and lo [N, K / group_size] (fp32). `input_perm`: the layer computes x[..., input_perm] @ w.T
        (GPTQ's act-order checkpoints, whose groups are contiguous only once the inputs are permuted).
        Activations stay unquantized (W4A16 formats define their output so) unless `int8_activations`."""
        return cls._from(q, scale.float(), lo.float(), None, bias, dtype, group_size, input_perm, int8_activations)

    @classmethod
    def from_zero_points(cls, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bias: torch.Tensor | None,
                         dtype: torch.dtype, group_size: int, input_perm: torch.Tensor | None = None) -> "Int4Linear":
        """The same for w = (q - zero) * scale (GPTQ, AWQ, compressed-tensors): kept as fp16 scale and zero
        point where both are fp16 (then 16 bits a pair, min = -zero * scale formed exactly in the kernel)."""
        scale, zero = scale.float(), zero.float()
        return cls._from(q, scale, -zero * scale, zero, bias, dtype, group_size, input_perm, False)

    @classmethod
    def _from(cls, q, scale, lo, zero, bias, dtype, group_size, input_perm, int8_activations) -> "Int4Linear":
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self._pack(q.to(torch.int32), scale, lo, bias, dtype, group_size, q.device, zero)
        self.int8_activations = int8_activations
        if input_perm is not None:
            self.input_perm = input_perm.long()
        return self

    def _pack(self, q, scale, lo, bias, dtype, group_size, device, zero=None) -> None:
        n, k = q.shape
        self.in_features, self.out_features, self.group_size, self.dtype = k, n, group_size, dtype
        self.register_buffer("input_perm", None)
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(dtype), requires_grad=False)
        self.ext = cpu_ext.load() if device.type == "cpu" else None
        self.zero_point = False
        if self.ext is not None:
            # pagedcore's kernel: w = q * scale + min with scale and min kept exactly: fp16 panels where every
            # value is an fp16 (GGUF's, pagedcore's own, symmetric GPTQ's); fp16 scale and zero point where
            # those are (asymmetric GPTQ / AWQ / compressed-tensors: -zero * scale rarely is); else fp32.
            if exactly_fp16(scale) and exactly_fp16(lo):
                scale, lo = scale.half(), lo.half()
            elif zero is not None and exactly_fp16(scale) and exactly_fp16(zero):
                scale, lo, self.zero_point = scale.half(), zero.half(), True
            packed, scale_min = self.ext.pack_int4_weight(q.to(torch.uint8), scale, lo, group_size)
            self.register_buffer("packed", packed)
            self.register_buffer("scales_and_zeros", scale_min)
            return
        # torch's kernel computes (q - 8) * scale + zero, scale and zero in the activation dtype.
        zero = lo + 8 * scale
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))
        self.register_buffer("scales_and_zeros", torch.stack([scale, zero], -1).transpose(0, 1).contiguous().to(dtype))

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the de-quantized weight [*ids.shape, in_features] in the layer's dtype, read from the
        panels (pagedcore's kernel layout: row n is column n % 16 of panel n // 16, its codes the low (n % 16
        < 8) or high nibbles of the quads' bytes): what an input embedding tied to this layer embeds."""
        k, g = self.in_features, self.group_size
        panel, column = ids // 16, ids % 16
        quads = self.packed.view(self.packed.shape[0], -1, 8, 4)[panel, :, column % 8, :]  # [*ids, Kp / 4, 4]
        codes = torch.where((column < 8)[..., None, None], quads & 15, quads >> 4)
        codes = codes.reshape(*ids.shape, -1)[..., :k].view(*ids.shape, k // g, g).float()
        scale_min = self.scales_and_zeros[panel, :, :, column].float()  # [*ids, K / G, 2]
        scale, second = scale_min[..., 0], scale_min[..., 1]
        lo = -second * scale if self.zero_point else second
        return (codes * scale[..., None] + lo[..., None]).view(*ids.shape, k).to(self.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_perm is not None:
            x = x.index_select(-1, self.input_perm)
        if self.ext is not None:
            return self.ext.packed_linear_int4(x, self.packed, self.scales_and_zeros, self.out_features,
                                               self.group_size, self.bias,
                                               INT8_ACTIVATION_ROWS if self.int8_activations else 0, self.zero_point)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(x.reshape(-1, self.in_features), self.packed,
                                                         self.group_size, self.scales_and_zeros)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)


def quantize_int4(model: nn.Module, device: torch.device, group_size: int = GROUP_SIZE) -> int:
    """Replace every nn.Linear the kernel can take (input width a multiple of `group_size`, output width of
    16); returns how many. An input embedding tied to a replaced layer (one Parameter with the LM head) then
    looks its rows up in the int4 panels (`Int4Linear.rows`) and drops its 16-bit table. A tracked model
    records the undo (the original linears, installs.py) and keeps its embedding as it is."""
    if device.type != "cpu":
        raise ValueError("quantization='int4' uses torch's CPU int4 kernel: run it on the CPU")
    if group_size not in GROUP_SIZES:
        raise ValueError(f"int4 group size {group_size}; supported: {', '.join(map(str, GROUP_SIZES))}")
    dtype = next(model.parameters()).dtype
    targets = [(name, m) for name, m in model.named_modules()
               if isinstance(m, nn.Linear) and m.in_features % group_size == 0 and m.out_features % 16 == 0]
    embeddings = {id(m.weight): m for m in model.modules() if type(m) is nn.Embedding and m.max_norm is None}
    tracked = installs.is_tracked(model)
    undos = []
    for name, linear in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        int4 = Int4Linear(linear, dtype, group_size)
        setattr(parent, child, int4)
        undos.append(functools.partial(setattr, parent, child, linear))
        embedding = embeddings.get(id(linear.weight))
        if embedding is not None and not tracked and int4.ext is not None:
            installs.set_forward(embedding, int4.rows)
            embedding.weight = nn.Parameter(embedding.weight.new_empty(0), requires_grad=False)
    installs.record(model, installs.undo_all(undos))
    return len(targets)


class Int8Linear(nn.Module):
    """Weight-only int8 linear: w = q * scale, q int8 [N, K], scale [N] (one per output channel) or
    [N, K / group_size] (groups: GGUF Q8_0, compressed-tensors' group strategy).

    On the CPU with the C++ ops: pagedcore's int8 panels (kernels/csrc/cpu_gemm_int8.cpp), scales in fp16 where
    every one is one (Q8_0's d), else fp32; `int8_activations` (GGUF's Q8_0, as llama.cpp computes it)
    quantizes decode rows' activations to int8 per 32 inputs, W8A16 formats keep fp32 activations.
    Otherwise torch: per channel `_weight_int8pack_mm`, groups widened per call (exact, slower)."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
                 group_size: int | None = None, int8_activations: bool = False):
        super().__init__()
        n, k = q.shape
        self.in_features, self.out_features = k, n
        self.group_size = None if group_size in (None, k) else group_size
        self.int8_activations = int8_activations
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(dtype), requires_grad=False)
        self.ext = cpu_ext.load() if q.device.type == "cpu" else None
        if self.ext is not None:
            group = self.group_size or k
            scale = scale.float().reshape(n, k // group)
            packed, scales = self.ext.pack_int8_weight(q.to(torch.int8), scale.half() if exactly_fp16(scale) else scale,
                                                       group)
            self.register_buffer("qweight", packed)
            self.register_buffer("scale", scales)
            return
        self.register_buffer("qweight", q.to(torch.int8).contiguous())
        # per channel: torch's kernel takes the scales in the activation dtype; groups keep fp32 (GGUF's fp16 exactly)
        self.register_buffer("scale", scale.reshape(n).to(dtype) if self.group_size is None else scale.float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ext is not None:
            return self.ext.packed_linear_int8(x, self.qweight, self.scale, self.out_features,
                                               self.group_size or self.in_features, self.bias,
                                               INT8_ACTIVATION_ROWS if self.int8_activations else 0)
        x2 = x.reshape(-1, self.in_features)
        if self.group_size is None:
            out = torch.ops.aten._weight_int8pack_mm(x2, self.qweight, self.scale.to(x.dtype))
        else:
            n, g = self.out_features, self.group_size
            w = (self.qweight.view(n, -1, g) * self.scale[..., None]).view(n, self.in_features).to(x.dtype)
            out = x2 @ w.t()
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)

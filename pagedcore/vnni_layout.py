"""bf16 linears in the VNNI pair layout where AMX tiles or AVX512-BF16 run (kernels/csrc/cpu_gemm_vnni.cpp).

The 16-column panels (packed_linear.py) widen bf16 to fp32 for FMA: ~0.2 TFLOP/s on 2 cores, where AMX
multiplies bf16 tiles at 10-15x that, and AVX512-BF16's vdpbf16ps (AMD Zen 4) at 2x (0.38-0.42 against 0.18-0.20
TFLOP/s at 512 rows, `bench linears`). The pair layout is an AMX weight tile as is and, per input pair, one
64-byte row for AVX512-BF16's vdpbf16ps: one copy serves every row count, from a decode row (which streams it)
to a prefill (which multiplies in tiles), through the same op and inside the decode stack. Weights are packed
into it at load, in place of the panels, where in_features is a multiple of 32 (an AMX tile's depth).

`PAGEDCORE_VNNI`: "auto" (where AMX or AVX512-BF16 runs), "on" (any CPU: the op runs a scalar loop over the
same layout where neither does, so tests cover it everywhere), "off".
"""

from __future__ import annotations

import os

import torch

DEPTH = 32  # inputs per AMX tile: in_features must be a multiple
SETTINGS = ("auto", "on", "off")


def _setting(value: str) -> str:
    if value not in SETTINGS:
        raise ValueError(f"PAGEDCORE_VNNI={value!r}; supported: {', '.join(SETTINGS)}")
    return value


SETTING = _setting(os.environ.get("PAGEDCORE_VNNI", "auto"))


def enabled(ext) -> bool:
    """Whether bf16 weights are packed in pairs: forced, or AMX or AVX512-BF16's vdpbf16ps runs here."""
    return SETTING == "on" or (SETTING == "auto" and ext is not None and (ext.vnni_amx() or ext.vnni_dpbf16()))


def applies(ext, weight: torch.Tensor) -> bool:
    return weight.dtype == torch.bfloat16 and weight.dim() == 2 and weight.shape[1] % DEPTH == 0 and enabled(ext)


def is_packed(packed: torch.Tensor) -> bool:
    """A weight in the pair layout, [panels, K / 2, 32] (panels are [panels, K, 16])."""
    return packed.dtype == torch.bfloat16 and packed.dim() == 3 and packed.shape[2] == 2 * 16


def rows(packed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of the [N, K] weight packed in pairs (a tied embedding's lookup): row n is in panel n // 16,
    its input pair j at [j, 2 (n % 16) : 2 (n % 16) + 2]."""
    panels, pairs = packed.shape[:2]
    return packed.view(panels, pairs, 16, 2)[ids // 16, :, ids % 16].flatten(-2)

"""bf16 linears past a few rows through oneDNN's pre-packed matmul, on CPUs with AMX tiles: from 3 rows beside
the panels, from PREFILL_ROWS beside the VNNI pairs (vnni_layout.py, the default there), whose own AMX kernel is
faster up to ~1000 rows and slower for 2048-row prefill chunks.

The panels of packed_linear.py widen bf16 to fp32 and multiply with FMA (~0.2 TFLOP/s on 2 cores). A CPU
with AMX (Intel Sapphire Rapids and later) multiplies bf16 in tiles: oneDNN reached 2-3 TFLOP/s on 2 cores
where the panels reached 0.2, so past a few rows they lose 5-10x (`pagedcore bench linears`). At one
row a step only streams the weight and the panels (and the decode stack built on them) stay.

The weight is reordered once at load into oneDNN's blocked layout (an opaque tensor; what inductor's CPU
freezing does), beside the panels: bf16 weights are resident twice on such CPUs, the price of both paths.
Results equal the panels' up to the order of the fp32 sums (both accumulate in fp32, round once).
"""

from __future__ import annotations

import functools
import os

import torch

# Rows from which a bf16 linear runs oneDNN (None: never). `PAGEDCORE_ONEDNN`: "auto" (AMX CPUs, from
# MIN_ROWS rows), "off", or a row count (any CPU: oneDNN runs without AMX too, slower; the tests use it).
MIN_ROWS = 3  # measured: the panels ran 1-2 rows faster (12.8 vs 15.1 ms a step), 3 rows 1.5x slower
# Measured against the VNNI pairs' AMX kernel over a step's linears: 64 rows 16.0 vs 16.3 ms, 128 rows 23.4 vs 22.7,
# 512 rows 75 vs 60 (bench throughput's prefill-heavy mix: 615-623 tok/s on the pairs alone, 663-678 before them).
# Since the pairs' AMX tiles read x in place (session 48, AMX Xeon, `bench linears`, us a call, a layer's qkv + o +
# gate_up + down): 512 rows 2179 vs 2542 and 1024 rows 4258 vs 5182 (ours ahead on all but gate_up), 2048 rows 7869
# vs 6379 (oneDNN ahead on all). Offline (`bench throughput`, mostly 2048-token prompt chunks), oneDNN from 128 /
# 1024 rows / never: 697, 696 / 691, 692 / 667, 601 tok/s.
PREFILL_ROWS = 1024


def _rows_from(setting: str) -> int | None:
    if setting == "off":
        return None
    if setting == "auto":
        return MIN_ROWS if _has_amx() else None
    if setting.isdigit() and int(setting) > 0:
        return int(setting)
    raise ValueError(f"PAGEDCORE_ONEDNN={setting!r}; supported: auto, off, or a row count >= 1")


def _has_amx() -> bool:
    check = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(check and check()) and torch.backends.mkldnn.is_available()


ROWS = _rows_from(os.environ.get("PAGEDCORE_ONEDNN", "auto"))


@functools.cache
def available() -> bool:
    """Whether oneDNN pre-packs bf16 weights on this CPU: it needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT, and refuses
    on AVX2-only CPUs (AMD Zen 3), where a forced row count (PAGEDCORE_ONEDNN=N) then leaves the panels running."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 32, dtype=torch.bfloat16), 1)
    except (RuntimeError, AttributeError):
        return False
    return True


def prepack(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight in oneDNN's layout, or None where oneDNN is not used for it (or cannot pack it here)."""
    if ROWS is None or weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or not available():
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 64)


def min_rows(vnni: bool) -> int | None:
    """From how many rows a weight with a oneDNN copy runs it: ROWS beside panels; beside VNNI pairs (AMX tiles
    of our own, vnni_layout.py), only from PREFILL_ROWS, where oneDNN's blocking multiplies faster."""
    return None if ROWS is None else max(ROWS, PREFILL_ROWS) if vnni else ROWS


def runs(x: torch.Tensor, packed: torch.Tensor | None, vnni: bool = False) -> bool:
    """Whether `x` goes through oneDNN: a pre-packed weight and at least min_rows(vnni) rows."""
    rows = min_rows(vnni)
    return packed is not None and rows is not None and x.numel() >= rows * x.shape[-1]


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")

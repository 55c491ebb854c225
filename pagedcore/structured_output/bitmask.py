"""Apply a token bitmask to logits rows: disallowed tokens get -inf."""

from __future__ import annotations

import torch

try:  # xgrammar's C++ apply (CPU) / CUDA kernel; the torch version below where it is missing
    from xgrammar import apply_token_bitmask_inplace as _xgr_apply
except ImportError:  # pragma: no cover - xgrammar is the default backend's own dependency
    _xgr_apply = None


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """In place on `logits[rows]`; `bitmask` is int32 [B, ceil(V / 32)] aligned with the logits rows."""
    bitmask = bitmask.to(logits.device, non_blocking=True)
    if _xgr_apply is not None:
        _xgr_apply(logits, bitmask, vocab_size=logits.shape[-1], indices=rows)
        return
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bitmask[index].unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :logits.shape[-1]]
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))

"""Apply a token bitmask to logits rows: disallowed tokens get -inf."""

from __future__ import annotations

import functools

import torch


@functools.cache
def _xgr_apply():
    """xgrammar's C++ apply (CPU) / CUDA kernel, or None (the torch version below). Imported on first use:
    xgrammar pulls in much of transformers at import (~0.3-1 s of every engine start otherwise)."""
    try:
        from xgrammar import apply_token_bitmask_inplace
    except ImportError:  # pragma: no cover - xgrammar is the default backend's own dependency
        return None
    return apply_token_bitmask_inplace


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """In place on `logits[rows]`; `bitmask` is int32 [B, ceil(V / 32)] aligned with the logits rows."""
    bitmask = bitmask.to(logits.device, non_blocking=True)
    apply = _xgr_apply()
    if apply is not None:
        apply(logits, bitmask, vocab_size=logits.shape[-1], indices=rows)
        return
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bitmask[index].unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :logits.shape[-1]]
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))

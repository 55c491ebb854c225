"""The batched LoRA products over a flattened batch, in torch (Punica's SGMV and BGMV, vLLM's names).

Every token t carries an adapter slot s_t (-1: the base model); a LoRA linear adds
`y[t] += B[s_t] @ (A[s_t] @ x[t])` (scale already folded into B). Two ways to batch it:
- SGMV (segmented): tokens grouped by slot, two matmuls per slot present in the step. On the CPU
  this is the path: a matmul over a group runs at GEMM speed and a step holds at most max_loras
  groups.
- BGMV (gathered): each token's own A and B gathered, one batched matrix-vector product per token.
  The reference for the Triton kernel (kernels/lora_bgmv.py), which does this per token on CUDA.
- Stacked (CPU, several adapters in a small step): the slots the step spans side by side, x @ [A_lo..A_hi]
  for every token, a one-hot mask keeping each token's own rank columns, then @ [B_lo..B_hi]. Two
  matmuls per layer however many adapters mix, where SGMV pays gathers and scatters per adapter; it
  multiplies n_slots * R columns for every token, so it is used only while that stays small.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LoRAMapping:
    """One step's adapter layout, shared by every LoRA linear of the forward."""

    token_slots: torch.Tensor  # int64 [T] on the device: each token's slot, -1 for the base model
    # (slot, its tokens): a slice where they are one contiguous run (the usual case), else an index tensor
    groups: list[tuple[int, slice | torch.Tensor]]
    # For the stacked product: the slots lo..hi the step's adapters span, and each token's one-hot over
    # them ([T, hi - lo + 1], float32; zero rows for base tokens). None when one contiguous run is all.
    span: slice | None = None
    onehot: torch.Tensor | None = None


def sgmv(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, ranks: list[int],
         groups: list[tuple[int, slice | torch.Tensor]]) -> torch.Tensor:
    """y [T, out] += per-group (x[g] @ A[s, :r].T) @ B[s, :, :r].T, in place; x [T, in];
    a [S, R, in]; b [S, out, R]; ranks[s] = 0 skips slot s (no weights for this layer)."""
    for slot, rows in groups:
        r = ranks[slot]
        if r == 0:
            continue
        if isinstance(rows, slice):
            y[rows].addmm_(x[rows] @ a[slot, :r].T, b[slot, :, :r].T)
        else:
            y.index_add_(0, rows, (x.index_select(0, rows) @ a[slot, :r].T) @ b[slot, :, :r].T)
    return y


def bgmv(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    """y [T, out] += B[s_t] @ (A[s_t] @ x[t]) for every token with s_t >= 0, in place (zero-padded ranks)."""
    rows = (token_slots >= 0).nonzero().squeeze(1)
    if rows.numel():
        s = token_slots[rows]
        shrunk = torch.bmm(a[s], x[rows].unsqueeze(2))  # [n, R, 1]
        y.index_add_(0, rows, torch.bmm(b[s], shrunk).squeeze(2).to(y.dtype))
    return y


def make_mapping(slots_per_seq: list[int], tokens_per_seq: list[int], device: torch.device) -> LoRAMapping | None:
    """The mapping of a step whose sequences (in batch order) run under `slots_per_seq` with
    `tokens_per_seq` tokens each; None when no token uses an adapter (base-only steps pay nothing)."""
    if all(s < 0 for s in slots_per_seq):
        return None
    token_slots = torch.repeat_interleave(torch.tensor(slots_per_seq, dtype=torch.int64),
                                          torch.tensor(tokens_per_seq, dtype=torch.int64))
    groups = []
    for slot in sorted({s for s in slots_per_seq if s >= 0}):
        idx = (token_slots == slot).nonzero().squeeze(1)
        first, last = int(idx[0]), int(idx[-1])
        rows = slice(first, last + 1) if last - first + 1 == idx.numel() else idx.to(device)
        groups.append((slot, rows))
    span = onehot = None
    if len(groups) > 1 or not isinstance(groups[0][1], slice):
        lo, hi = groups[0][0], groups[-1][0]
        span = slice(lo, hi + 1)
        onehot = torch.zeros(len(token_slots), hi - lo + 1)
        used = token_slots >= 0
        onehot[used.nonzero().squeeze(1), token_slots[used] - lo] = 1.0
        onehot = onehot.to(device)
    return LoRAMapping(token_slots.to(device), groups, span, onehot)


def stacked(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b_rows: torch.Tensor, span: slice,
            onehot: torch.Tensor) -> torch.Tensor:
    """y [T, out] += ((x @ A_cat.T) * mask) @ B_cat, in place; a [S, R, in]; b_rows [S, R, out] (B
    transposed per slot, so the span is one contiguous [n*R, out] view); onehot [T, n]."""
    n, rank = onehot.shape[1], a.shape[1]
    h = (x @ a[span].reshape(n * rank, -1).T).view(-1, n, rank)
    h = (h * onehot.to(h.dtype).unsqueeze(2)).view(-1, n * rank)
    return y.addmm_(h, b_rows[span].reshape(n * rank, -1))


# The stacked product multiplies every token by n_slots * R columns of A and B, most of them masked.
# Measured (576 -> 1536, rank 16, fp32, 2 threads, tokens round robin over the adapters): 4 adapters
# 183 vs SGMV's 442 us at 16 tokens, 307 vs 490 at 64; 16 adapters (256 columns) 996 vs 1499 at 64.
# Past these bounds (long prefills, which come in contiguous runs) SGMV wastes nothing.
STACKED_MAX_COLUMNS = 256
STACKED_MAX_TOKENS = 256


def add_lora(y: torch.Tensor, x: torch.Tensor, slots, mapping: LoRAMapping) -> torch.Tensor:
    """One LoRA linear's products for a step: the Triton BGMV kernel on CUDA; on the CPU the stacked
    product for a small step of several adapters, else SGMV."""
    if y.is_cuda:
        from pagedcore.kernels import lora_bgmv

        if lora_bgmv.available():
            return lora_bgmv.add_lora(y, x, slots.a, slots.b, mapping.token_slots)
    if (mapping.onehot is not None and slots.b_rows is not None and y.shape[0] <= STACKED_MAX_TOKENS
            and mapping.onehot.shape[1] * slots.a.shape[1] <= STACKED_MAX_COLUMNS):
        return stacked(y, x, slots.a, slots.b_rows, mapping.span, mapping.onehot)
    return sgmv(y, x, slots.a, slots.b, slots.ranks, mapping.groups)

"""Logits processors of the sampler (pagedcore/sampler.py), each a pure op over a batch [B, V]: repetition,
presence and frequency penalties, top-k, top-p and min-p. Rows a processor leaves alone come back unchanged."""

from __future__ import annotations

import torch

_NEG_INF = float("-inf")


def token_counts(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, L] ids padded with vocab_size -> [B, V] occurrence counts (long)."""
    B = token_ids.shape[0]
    counts = torch.zeros(B, vocab_size + 1, dtype=torch.long, device=token_ids.device)
    counts.scatter_add_(1, token_ids, torch.ones_like(token_ids))
    return counts[:, :vocab_size]


def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: torch.Tensor | None,
    output_token_ids: torch.Tensor | None,
    presence_penalties: torch.Tensor | None,
    frequency_penalties: torch.Tensor | None,
    repetition_penalties: torch.Tensor | None,
) -> torch.Tensor:
    """Repetition (HF, prompt + output), then frequency/presence (OpenAI, output only).

    Token id tensors are [B, L] padded with V. A None penalty tensor is skipped.
    Returns a new tensor; `logits` is not modified.
    """
    V = logits.shape[-1]
    output_counts = token_counts(output_token_ids, V) if output_token_ids is not None else None
    if repetition_penalties is not None:
        seen = token_counts(prompt_token_ids, V) > 0
        if output_counts is not None:
            seen |= output_counts > 0
        rep = repetition_penalties.unsqueeze(1)
        # Dividing a positive logit and multiplying a negative one both make the
        # token less likely (for p > 1), which a plain division would not.
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalised, logits)
    if presence_penalties is not None:
        counts = output_counts.to(logits.dtype)
        logits = logits - frequency_penalties.unsqueeze(1) * counts
        logits = logits - presence_penalties.unsqueeze(1) * (counts > 0).to(logits.dtype)
    return logits


def apply_top_k(logits: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Keep each row's k largest logits (ties at the k-th value kept); k <= 0 or >= V: off."""
    V = logits.shape[-1]
    off = (k <= 0) | (k >= V)
    k = k.masked_fill(off, 1)
    # One topk with the batch's largest k, not a full sort of the vocabulary.
    top = logits.topk(int(k.max()), dim=-1).values
    threshold = top.gather(1, (k - 1).unsqueeze(1))
    threshold = threshold.masked_fill(off.unsqueeze(1), _NEG_INF)
    return logits.masked_fill(logits < threshold, _NEG_INF)


# Candidates top-p looks at before sorting the whole vocabulary (see apply_top_p).
TOP_P_CANDIDATES = 1024


def apply_top_p(logits: torch.Tensor, p: torch.Tensor, candidates: int = TOP_P_CANDIDATES) -> torch.Tensor:
    """Keep each row's smallest most-probable prefix with mass >= p; p >= 1: off.

    The prefix almost always lies among a row's few hundred largest logits, and sorting all of a
    49k vocabulary costs ~8 ms a row on a CPU core (B = 64: ~0.5 s a step, more than the forward).
    So the `candidates` largest logits come first (one topk, ~15x cheaper); when, in every row, they
    hold mass >= p (p < 1), the cut is among them and the result equals the full sort's. Otherwise
    (flat distributions, p = 1 rows) the whole vocabulary is sorted."""
    V = logits.shape[-1]
    if candidates < V and bool((p < 1.0).all()):
        top, order = logits.topk(candidates, dim=-1)
        probs = (top - logits.logsumexp(dim=-1, keepdim=True)).exp()
        cumsum = probs.cumsum(dim=-1)
        if bool((cumsum[:, -1] >= p).all()):
            mass_before = torch.cat([torch.zeros_like(cumsum[:, :1]), cumsum[:, :-1]], dim=-1)
            drop_sorted = mass_before >= p.unsqueeze(1)
            drop_sorted[:, 0] = False
            return torch.full_like(logits, _NEG_INF).scatter_(1, order, top.masked_fill(drop_sorted, _NEG_INF))
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    cumsum = probs.cumsum(dim=-1)
    # Mass strictly before each token: the token is needed while that is < p.
    # (Shifted cumsum, not cumsum - probs, which would add a rounding error.)
    mass_before = torch.cat([torch.zeros_like(cumsum[:, :1]), cumsum[:, :-1]], dim=-1)
    # p = 1 must be a no-op even where float32 cumsum tops out just below 1.
    p = p.masked_fill(p >= 1.0, float("inf")).unsqueeze(1)
    drop_sorted = mass_before >= p
    drop_sorted[:, 0] = False  # the top token always survives
    drop = torch.empty_like(drop_sorted).scatter_(1, order, drop_sorted)
    return logits.masked_fill(drop, _NEG_INF)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p * (the row's top probability)."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, _NEG_INF)

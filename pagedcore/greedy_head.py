"""Greedy rows' next tokens without their logits: the LM head's argmax from int8 codes and a few exact logits.

A greedy request that asks for no logprobs needs only the argmax of its logits row, yet the LM head is the
largest linear of a small model (the bundled SmolLM2's: 113 MB of fp32, ~11 ms of a 64-row decode step). The C++
kernel (kernels/csrc/cpu_greedy_head.cpp) scores every token from int8 codes of the head (a quarter of the bytes,
twice the fp32 rate through VNNI), bounds their error for any input, and computes exactly, as the fp32 panels do,
only the logits the bound cannot rule out: the token is the full logits' argmax, bit for bit. What it costs:
such requests report no cumulative logprob (`SamplingParams.argmax_only`; vLLM v1's contract); logprobs=0 asks
for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

PANEL = 16


@dataclass
class ArgmaxTokens:
    """A step's sampled rows as token ids only: what the decode stack returns instead of logits."""

    token_ids: torch.Tensor  # int64 [rows]


class GreedyHead:
    def __init__(self, ext, head: nn.Module, vocab_size: int, embedding: torch.Tensor | None = None):
        self.ext, self.head, self.vocab_size = ext, head, vocab_size
        self.forward = head.__dict__.get("forward")  # the packed forward the head had when the codes were made
        panels = head._pagedcore_packed
        weight = panels.permute(0, 2, 1).reshape(-1, panels.shape[1])[:vocab_size].contiguous()  # fp32: in order
        self.codes, self.stats = ext.greedy_head_pack(weight)
        # The exact logits read the weight by rows: a tied input embedding holding the same values serves (no copy).
        same = embedding is not None and embedding.dtype == torch.float32 and embedding.is_contiguous() \
            and embedding.shape == weight.shape and torch.equal(embedding, weight)
        self.weight = embedding if same else weight
        self.rows = self.exact = 0  # rows answered, logits computed exactly for them (stats)

    @classmethod
    def build(cls, ext, model: nn.Module) -> "GreedyHead | None":
        """For an fp32 LM head in packed panels, without bias, where the kernel runs; else None."""
        head = getattr(model, "lm_head", None)
        panels = getattr(head, "_pagedcore_packed", None)
        if ext is None or not ext.greedy_head_supported() or panels is None or getattr(head, "bias", None) is not None:
            return None
        if panels.dtype != torch.float32 or panels.dim() != 3 or panels.shape[2] != PANEL:
            return None
        vocab = head.out_features
        if vocab > panels.shape[0] * PANEL or panels.shape[1] > 1032:
            return None
        embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        return cls(ext, head, vocab, getattr(embed, "weight", None))

    def argmax(self, hidden: torch.Tensor) -> ArgmaxTokens | None:
        """The argmax of lm_head(hidden) per row; None where the head was replaced since, or a row (its input or
        a logit the bound kept) is not finite: the caller then computes the logits."""
        if self.head.__dict__.get("forward") is not self.forward or hidden.dtype != torch.float32:
            return None
        tokens, exact = self.ext.greedy_head(hidden, self.codes, self.stats, self.weight)
        if bool((tokens < 0).any()):
            return None
        self.rows += len(tokens)
        self.exact += int(exact.sum())
        return ArgmaxTokens(tokens)

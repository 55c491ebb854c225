"""Shared by the Sampler tests (test_sampler*.py): random logits, a SamplingBatch with defaults, the keep-mask."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, settings

from pagedcore.sampler import SamplingBatch

NEG_INF = float("-inf")
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def random_logits(seed: int, B: int, V: int, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, V, generator=g) * scale


def build(params, vocab_size, prompts=None, outputs=None, generators=None, eos=(0,)):
    B = len(params)
    return SamplingBatch.build(
        params,
        prompts if prompts is not None else [[] for _ in range(B)],
        outputs if outputs is not None else [[] for _ in range(B)],
        generators if generators is not None else [None] * B,
        list(eos),
        vocab_size,
        "cpu",
    )


def kept(masked: torch.Tensor) -> list[list[bool]]:
    return (masked != NEG_INF).tolist()

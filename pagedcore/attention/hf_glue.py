"""Routes every transformers attention layer to the engine's paged attention, with no per-model code.

transformers calls `ALL_ATTENTION_FUNCTIONS[config._attn_implementation](module, q, k, v, mask, ...)`
after projections and RoPE. We register "pagedcore" there; the per-step state (backend, its
metadata, the KV cache) sits in a forward context set by the model runner around each forward.
Because "pagedcore" has no mask function registered, transformers builds no attention mask at all.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

ATTN_IMPLEMENTATION = "pagedcore"


@dataclass
class ForwardContext:
    backend: Any
    metadata: Any
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]


_context: ForwardContext | None = None


@contextlib.contextmanager
def forward_context(ctx: ForwardContext):
    global _context
    prev, _context = _context, ctx
    try:
        yield
    finally:
        _context = prev


def current() -> ForwardContext | None:
    """The engine's per-step state while a forward runs inside `forward_context`, else None."""
    return _context


def paged_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """query: [1, Hq, T, D]; key/value: [1, Hkv, T, D] for this step's T flattened tokens."""
    ctx = _context
    if ctx is None:
        raise RuntimeError("pagedcore attention called outside the engine's forward context")
    k_cache, v_cache = ctx.kv_caches[module.layer_idx]
    out = ctx.backend.forward(
        query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
        k_cache, v_cache, ctx.metadata,
        scale=scaling if scaling is not None else query.shape[-1] ** -0.5,
        sliding_window=kwargs.get("sliding_window"),
        softcap=kwargs.get("softcap"),
    )
    return out.unsqueeze(0), None  # [1, T, Hq, D], as transformers' own attention functions return


def install(model) -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)

"""Routes every transformers attention layer to the engine's paged attention, with no per-model code.

transformers calls `ALL_ATTENTION_FUNCTIONS[config._attn_implementation](module, q, k, v, mask, ...)`
after projections and RoPE. We register "pagedcore" there; the per-step state (backend, its
metadata, the KV cache) sits in a forward context set by the model runner around each forward.
Because "pagedcore" has no mask function registered, transformers builds no attention mask at all.

The forward context is a `ContextVar`, not a module global: each thread (and each asyncio task)
sees only the context its own engine set, so engines stepping in their own threads (AsyncLLMEngine,
two `LLM`s in one process) never read each other's metadata or KV caches.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Any

import torch

from pagedcore import installs

ATTN_IMPLEMENTATION = "pagedcore"


@dataclass
class ForwardContext:
    backend: Any
    metadata: Any
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    lora_mapping: Any = None  # lora/punica.py's LoRAMapping when a token of the step runs under an adapter
    # The last layer's rows that go on (the sampled tokens'; None: all): that layer writes every token's K/V, then
    # runs o_proj and the MLP on these rows alone, which the model's norm and head then take (lean_layers.py).
    keep_rows: torch.Tensor | None = None
    keep_rows_layer: int = -1


_context: contextvars.ContextVar[ForwardContext | None] = contextvars.ContextVar("pagedcore_forward_context",
                                                                               default=None)


@contextlib.contextmanager
def forward_context(ctx: ForwardContext):
    """Make `ctx` the current forward context of this thread (or task) while the block runs."""
    token = _context.set(ctx)
    try:
        yield
    finally:
        _context.reset(token)


def current() -> ForwardContext | None:
    """This thread's engine step state while a forward runs inside `forward_context`, else None."""
    return _context.get()


def paged_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """query: [1, Hq, T, D]; key/value: [1, Hkv, T, D] for this step's T flattened tokens."""
    ctx = _context.get()
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
    """Switch the model to paged attention; a tracked model records the switch back (installs.py)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    previous = model.config._attn_implementation
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    installs.record(model, lambda: model.set_attn_implementation(previous))

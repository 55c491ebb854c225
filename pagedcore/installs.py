"""What the engine installs on a model it is given, and how to take all of it off again.

The engine changes its model in place: paged attention (attention/hf_glue.py), fused RMSNorms
(fused_norms.py), lean decoder layers (lean_layers.py), packed linears (packed_linear.py), int4
linears (quantization.py). A model the engine loaded itself keeps them for good. A model lent to it
(the hf adapter's `patch(model)`) must come back as it was: its owner calls `track(model)` before
the engine is made and `restore(model)` when done. While a model is tracked, each install records
how to undo itself; `restore` runs the undos newest first.

Nothing is recorded on an untracked model: int4's undo keeps the full-precision linears alive, which
an engine that owns its model must not pay for.
"""

from __future__ import annotations

from typing import Callable

import torch

Undo = Callable[[], None]

_UNDO_ATTR = "_pagedcore_undo"


def track(model: torch.nn.Module) -> None:
    """From now on, installs on `model` record their undo (until `restore`)."""
    model.__dict__.setdefault(_UNDO_ATTR, [])


def is_tracked(model: torch.nn.Module) -> bool:
    return _UNDO_ATTR in model.__dict__


def record(model: torch.nn.Module, undo: Undo) -> None:
    """Remember how to undo one install on `model`, if it is tracked."""
    undos = model.__dict__.get(_UNDO_ATTR)
    if undos is not None:
        undos.append(undo)


def restore(model: torch.nn.Module) -> int:
    """Undo every install recorded since `track(model)`, newest first, and stop tracking; returns how many."""
    undos = model.__dict__.pop(_UNDO_ATTR, [])
    for undo in reversed(undos):
        undo()
    return len(undos)


def set_forward(module: torch.nn.Module, forward: Callable) -> Undo:
    """`module.forward = forward`; returns the undo: the instance forward it had before, or none."""
    had, previous = "forward" in module.__dict__, module.__dict__.get("forward")
    module.forward = forward

    def undo() -> None:
        if had:
            module.forward = previous
        else:
            module.__dict__.pop("forward", None)

    return undo


def undo_all(undos: list[Undo]) -> Undo:
    """One undo for a list of them, run newest first."""
    def undo() -> None:
        for u in reversed(undos):
            u()

    return undo

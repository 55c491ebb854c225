"""LoRA linears: each servable projection keeps its own forward (F.linear, packed, int4, a plugin's)
and adds its adapters' products for the tokens that run under one.

The adapter weights of a layer live in stacked slot buffers, as on a GPU: A [max_loras, R, in] and
B [max_loras, out, R], zero-padded to R = max_lora_rank; the manager (manager.py) writes an
adapter's matrices into a slot. The step's per-token slots (punica.LoRAMapping) arrive through the
engine's forward context; without one (a base-only step, or code outside the engine) the layer is
its base forward and nothing more.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedcore import installs
from pagedcore.attention import hf_glue
from pagedcore.lora import punica

# The projections of a decoder layer an adapter may target (Llama/Mistral/Qwen2/Gemma/Phi-3 names).
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "gate_proj", "up_proj", "down_proj",
                  "gate_up_proj")


class LoRASlots:
    """The stacked adapter buffers of one linear."""

    def __init__(self, in_features: int, out_features: int, max_loras: int, max_rank: int,
                 device: torch.device, dtype: torch.dtype):
        self.a = torch.zeros(max_loras, max_rank, in_features, device=device, dtype=dtype)
        self.b = torch.zeros(max_loras, out_features, max_rank, device=device, dtype=dtype)
        # B transposed per slot, for the CPU's stacked product (punica.stacked); CUDA's kernel reads b
        self.b_rows = (None if device.type == "cuda"
                       else torch.zeros(max_loras, max_rank, out_features, device=device, dtype=dtype))
        self.ranks = [0] * max_loras  # 0: the slot's adapter does not touch this layer

    def set(self, slot: int, weights: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()
        if self.b_rows is not None:
            self.b_rows[slot].zero_()
        self.ranks[slot] = 0
        if weights is not None:
            a, b = weights
            r = a.shape[0]
            self.a[slot, :r].copy_(a)
            self.b[slot, :, :r].copy_(b)
            if self.b_rows is not None:
                self.b_rows[slot, :r].copy_(b.T)
            self.ranks[slot] = r


def servable_linears(model: nn.Module) -> dict[str, nn.Module]:
    """Module name -> module, for every projection in TARGET_MODULES with known in/out features."""
    return {name: m for name, m in model.named_modules()
            if name.rsplit(".", 1)[-1] in TARGET_MODULES and _features(m) is not None}


def _features(module: nn.Module) -> tuple[int, int] | None:
    if hasattr(module, "in_features") and hasattr(module, "out_features"):
        return module.in_features, module.out_features
    return None


def install(model: nn.Module, max_loras: int, max_rank: int, device: torch.device,
            dtype: torch.dtype) -> dict[str, LoRASlots]:
    """Wrap every servable linear's current forward; returns module name -> its slot buffers."""
    slots, undos = {}, []
    for name, module in servable_linears(model).items():
        in_features, out_features = _features(module)
        slots[name] = LoRASlots(in_features, out_features, max_loras, max_rank, device, dtype)
        undos.append(_wrap(module, slots[name]))
    installs.record(model, installs.undo_all(undos))
    return slots


def _wrap(module: nn.Module, slots: LoRASlots) -> installs.Undo:
    base = module.forward  # whatever it is now: F.linear, the packed kernel, int4

    def forward(x: torch.Tensor) -> torch.Tensor:
        y = base(x)
        ctx = hf_glue.current()
        mapping = None if ctx is None else ctx.lora_mapping
        if mapping is None:
            return y
        y2 = y.view(-1, y.shape[-1])
        punica.add_lora(y2, x.reshape(-1, x.shape[-1]), slots, mapping)
        return y

    return installs.set_forward(module, forward)

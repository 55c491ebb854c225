"""A fused CPU RMSNorm in place of transformers', installed on the engine's model.

transformers' Llama-style RMSNorm is ~8 aten ops (casts, pow, mean, rsqrt, muls); run 61 times per
step, on a CPU their dispatch and extra passes over memory cost more than the math. The C++ kernel
(kernels/csrc, built with the decode kernel) does one pass per row with the same semantics and the
same roundings; only its fp32 sum of squares runs in another order, so results match transformers'
within about an ulp (in bf16, >99% of elements bit-equal). Where the kernel is not
available, or off the CPU, nothing is replaced. A tracked model records the undo (installs.py).
"""

from __future__ import annotations

import torch

from pagedcore import installs
from pagedcore.kernels import cpu_ext

# Classes whose forward is exactly weight * (x.float() * rsqrt(mean(x^2) + eps)).to(x.dtype).
LLAMA_STYLE_RMSNORMS = {"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "Phi3RMSNorm"}


def patch_forwards(model: torch.nn.Module, device: torch.device, make_forward) -> int:
    """Set `module.forward = make_forward(ext, module)` on every module for which it returns one
    (on the CPU, with the C++ ops built), recording the undo on a tracked model; returns how many."""
    ext = cpu_ext.load() if device.type == "cpu" else None
    if ext is None:
        return 0
    undos = []
    for module in model.modules():
        forward = make_forward(ext, module)
        if forward is not None:
            undos.append(installs.set_forward(module, forward))
    installs.record(model, installs.undo_all(undos))
    return len(undos)


def install(model: torch.nn.Module, device: torch.device) -> int:
    """Patch the model's RMSNorm modules in place; returns how many."""
    def make(ext, module):
        if type(module).__name__ in LLAMA_STYLE_RMSNORMS and hasattr(module, "variance_epsilon"):
            return _fused_rmsnorm(ext, module)
        return None

    return patch_forwards(model, device, make)


def _fused_rmsnorm(ext, module):
    original = type(module).forward

    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        if hidden_states.dtype != module.weight.dtype or hidden_states.device.type != "cpu":
            return original(module, hidden_states)
        return ext.rms_norm(hidden_states, module.weight, module.variance_epsilon)

    return forward

"""The C++ packed linear as a torch operator, so `torch.compile` can keep it in a captured graph.

A pybind function (cpu_ext's `packed_linear`) is a graph break for dynamo; the operator registered
here is one opaque node with a known output shape (its fake implementation), which inductor calls
as an extern kernel between the elementwise code it generates.

Registered with `torch.library.Library` and the pybind function itself as the CPU kernel, not
with `torch.library.custom_op`: on this project's 2-core CPU a call through custom_op's Python
layers costs ~30 us over the pybind call, through the dispatcher alone ~13 us, and a decode step
makes one per linear (211 for SmolLM2-135M). Eager forwards keep calling cpu_ext directly.
"""

from __future__ import annotations

import torch

from pagedcore.kernels import cpu_ext

_lib = None


def register() -> bool:
    """Define `torch.ops.pagedcore.packed_linear` (once per process); False without the C++ ops."""
    global _lib
    if _lib is not None:
        return True
    ext = cpu_ext.load()
    if ext is None:
        return False
    lib = torch.library.Library("pagedcore", "FRAGMENT")
    lib.define("packed_linear(Tensor x, Tensor packed, int out_features, Tensor? bias) -> Tensor")
    lib.impl("packed_linear", ext.packed_linear, "CPU")
    torch.library.register_fake("pagedcore::packed_linear", _packed_linear_fake, lib=lib)
    _lib = lib
    return True


def _packed_linear_fake(x, packed, out_features, bias):
    return x.new_empty((*x.shape[:-1], out_features))

"""Every nn.Linear of the model runs over a weight packed once at load (CPU, fp32 and bf16).

`F.linear` re-lays its weight out for the matmul on every call, and on CPUs without bf16 matmul
units torch's bf16 matmul is a scalar loop (~1 GFLOP/s, 20-40x below the fp32 FMA rate). The C++
kernel (kernels/csrc/cpu_gemm.cpp) keeps each weight in 16-column panels in its own dtype, widens
it to fp32 in registers and accumulates in fp32, rounding the result once to the input's dtype.
Results equal `F.linear`'s up to the order of the fp32 sums.

Any HF decoder: the Linear modules themselves are patched (their `forward`), so transformers'
layers, the lean layers and plugins all run through it without per-model code. The original
weight stays on the module (tied embeddings, state dicts, `restore`). int4 linears keep their own
pre-packed kernel. A tracked model records the undo (installs.py). On CPUs with AMX tiles, bf16 weights are
packed in VNNI pairs instead of panels, for the same op (vnni_layout.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedcore import installs, onednn_linear, vnni_layout
from pagedcore.kernels import cpu_ext

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
PANEL = 16  # output columns per packed panel (kernels/csrc/cpu_gemm.cpp)
# The panel slot of each column in a bf16 panel (gemm_tiles.h's BF16_ORDER; fp32 panels are in order).
BF16_SLOTS = (0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15)


def install(model: nn.Module, device: torch.device) -> int:
    """Pack every plain nn.Linear's weight and route its forward through the packed kernel; returns
    how many. Nothing happens off the CPU or without the C++ ops."""
    ext = cpu_ext.load() if device.type == "cpu" else None
    if ext is None:
        return 0
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    undos = [_patch(ext, module, module is not head) for module in model.modules()
             if type(module) is nn.Linear and module.weight.dtype in PACKABLE_DTYPES
             and module.weight.device.type == "cpu" and not hasattr(module, "_pagedcore_packed")]
    installs.record(model, installs.undo_all(undos))
    return len(undos)


def release_dense(model: nn.Module) -> int:
    """Drop the dense weight of every packed linear of a model the engine owns: the packed copy is what
    runs, so keeping both doubled resident weight memory. A tied input embedding (one Parameter with an
    LM head) then looks its rows up in the head's panels: the same values, one copy. Nothing happens on
    a lent (tracked) model, which must come back as it was; returns how many weights were dropped."""
    if installs.is_tracked(model):
        return 0
    embeddings = {id(m.weight): m for m in model.modules() if type(m) is nn.Embedding and m.max_norm is None}
    count = 0
    for module in list(model.modules()):
        if getattr(module, "_pagedcore_packed", None) is None or module.weight.numel() == 0:
            continue
        embedding = embeddings.get(id(module.weight))
        empty = nn.Parameter(module.weight.new_empty(0), requires_grad=False)
        if embedding is not None:
            installs.set_forward(embedding, _panel_lookup(module))
            embedding.weight = empty
        module.weight = empty
        count += 1
    return count


def _panel_lookup(linear: nn.Linear):
    """Embedding rows from a packed [ceil(N / 16), K, 16] weight: row n is panel n // 16, in the slot of
    column n % 16 (or from VNNI pairs)."""
    packed = linear._pagedcore_packed
    slots = torch.tensor(BF16_SLOTS if packed.dtype == torch.bfloat16 else range(PANEL))

    def forward(ids: torch.Tensor) -> torch.Tensor:
        packed = linear._pagedcore_packed
        rows = linear.__dict__.get("_pagedcore_rows")
        if rows is not None and rows[0] is packed:  # the greedy head's row copy of these very pairs: ~10x faster
            return F.embedding(ids, rows[1])
        if vnni_layout.is_packed(packed):
            return vnni_layout.rows(packed, ids)
        return packed[ids // PANEL, :, slots[ids % PANEL]]

    return forward


def restore(model: nn.Module) -> int:
    """Undo `install`: the modules' own forward again, packed copies dropped; returns how many."""
    count = 0
    for module in model.modules():
        if hasattr(module, "_pagedcore_packed"):
            del module._pagedcore_packed
            module.__dict__.pop("_pagedcore_onednn", None)
            module.__dict__.pop("_pagedcore_rows", None)
            module.__dict__.pop("forward", None)
            count += 1
    return count


def _patch(ext, module: nn.Linear, prefill_copy: bool = True) -> installs.Undo:
    weight = module.weight.detach()
    vnni = vnni_layout.applies(ext, weight)
    packed = ext.pack_linear_weight_vnni(weight) if vnni else ext.pack_linear_weight(weight)
    out_features = module.out_features
    bias = None if module.bias is None else module.bias.detach()
    original = type(module).forward
    module._pagedcore_packed = packed
    # Beside VNNI pairs oneDNN's copy serves only prefill-sized inputs (onednn_linear.PREFILL_ROWS); the LM head
    # sees one row per sampled sequence, so its copy (54 MiB on the bundled model) would only cost memory.
    module._pagedcore_onednn = onednn_linear.prepack(module.weight) if prefill_copy or not vnni else None

    dtype = packed.dtype  # not the tensor itself: the closure must not keep a replaced weight alive

    def forward(x: torch.Tensor) -> torch.Tensor:
        if x.dtype != dtype or x.device.type != "cpu" or x.requires_grad:
            if module.weight.numel() == 0:
                raise RuntimeError(f"this linear keeps only its packed {dtype} CPU weight (release_dense): "
                                   f"input {x.dtype} on {x.device}, requires_grad={x.requires_grad}")
            return original(module, x)
        # Both looked up per call: fused_projections.py may re-point the panels at a slice of a fused weight,
        # and drop the oneDNN copy for the fused one.
        onednn = module._pagedcore_onednn
        if onednn_linear.runs(x, onednn, vnni):
            return onednn_linear.linear(x, onednn, bias)
        return ext.packed_linear(x, module._pagedcore_packed, out_features, bias)

    undo_forward = installs.set_forward(module, forward)

    def undo() -> None:  # idempotent: `restore` may have run first
        module.__dict__.pop("_pagedcore_packed", None)
        module.__dict__.pop("_pagedcore_onednn", None)
        undo_forward()

    return undo

"""The packed weights moved into one buffer of 2 MiB transparent huge pages once the model is set up.

A decode step streams nearly all the weights from memory; with 4 KiB pages every 4 KiB of that stream is a TLB
miss and a page walk. THP in the "madvise" mode most kernels ship only backs memory that asks for it, which torch's
allocator does not. Every packed tensor sharing a storage moves together (a fused q/k/v weight and its members'
views of it), in place (`Tensor.set_`), so closures and modules holding them see the new memory; the C++ decode
stack reads raw pointers, so this runs before it is built. The buffer lives as long as any tensor in it.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from pagedcore import fused_projections
from pagedcore.kernels import cpu_ext

logger = logging.getLogger(__name__)

ALIGN = 64  # each storage's start in the buffer (the kernels' vector loads)
MIN_BYTES = 8 << 20  # below this, not worth a buffer (tiny test models)
_QUANTIZED_BUFFERS = ("packed", "scales_and_zeros", "qweight", "scale")


def packed_tensors(model: nn.Module) -> list[torch.Tensor]:
    """Every packed weight tensor of `model` (views included), each once."""
    found: dict[int, torch.Tensor] = {}

    def add(t) -> None:
        if isinstance(t, torch.Tensor) and t.device.type == "cpu" and not t.requires_grad and t.numel():
            found.setdefault(id(t), t)

    for module in model.modules():
        add(module.__dict__.get("_pagedcore_packed"))
        if type(module).__name__ in ("Int4Linear", "Int8Linear"):
            for name in _QUANTIZED_BUFFERS:
                add(module._buffers.get(name))
    for fused in fused_projections.installed(model):
        for t in fused.spec[:2]:
            add(t)
    return list(found.values())


def install(model: nn.Module, device: torch.device) -> int:
    """Move the packed weights of `model` into huge pages; returns the bytes moved (0: nothing done)."""
    ext = cpu_ext.load() if device.type == "cpu" else None
    if ext is None or not hasattr(ext, "huge_page_buffer"):
        return 0
    by_storage: dict[int, list[torch.Tensor]] = {}
    for t in packed_tensors(model):
        by_storage.setdefault(t.untyped_storage().data_ptr(), []).append(t)
    sizes = {ptr: ts[0].untyped_storage().nbytes() for ptr, ts in by_storage.items()}
    offsets, total = {}, 0
    for ptr, n in sizes.items():
        offsets[ptr] = total
        total += (n + ALIGN - 1) // ALIGN * ALIGN
    if total < MIN_BYTES:
        return 0
    buffer = ext.huge_page_buffer(total)
    storage = buffer.untyped_storage()
    for ptr, ts in by_storage.items():
        off, n = offsets[ptr], sizes[ptr]
        buffer[off:off + n].copy_(torch.empty(0, dtype=torch.uint8).set_(ts[0].untyped_storage()))
        for t in ts:
            size = t.element_size()
            with torch.no_grad():
                t.set_(storage, off // size + t.storage_offset(), t.size(), t.stride())
    logger.info("packed weights in huge pages: %.1f MiB in %d storages", total / 2**20, len(by_storage))
    return total

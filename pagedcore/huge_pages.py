"""The packed weights moved into one buffer of 2 MiB transparent huge pages once the model is set up.

A decode step streams nearly all the weights from memory; with 4 KiB pages every 4 KiB of that stream is a TLB
miss and a page walk. THP in the "madvise" mode most kernels ship only backs memory that asks for it, which torch's
allocator does not. Every packed tensor sharing a storage moves together (a fused q/k/v weight and its members'
views of it), in place (`Tensor.set_`), so closures and modules holding them see the new memory; the C++ decode
stack reads raw pointers, so this runs before it is built. The buffer lives as long as any tensor in it.
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

import torch
from torch import nn

from pagedcore import fused_projections
from pagedcore.kernels import cpu_ext

logger = logging.getLogger(__name__)

ALIGN = 64  # each storage's start in the buffer (the kernels' vector loads)
MIN_BYTES = 8 << 20  # below this, not worth a buffer (tiny test models)
SURPLUS_FRACTION, SURPLUS_BYTES = 0.02, 4 << 20  # a prefaulted buffer's most unused bytes (Prefault.take)
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


# Model types whose packed bytes estimate_bytes can tell from config.json (the decode stack's Llama family).
ESTIMATED_MODEL_TYPES = ("llama", "mistral", "qwen2")
PANEL = 16  # output columns per packed panel (packed_linear.py, vnni_layout.py)


def estimate_bytes(config: dict, element_size: int) -> int | None:
    """An upper bound on the packed weights' bytes of a model of this config.json (each linear's panels padded to 16
    columns, the LM head included, fused groups counted member by member); None for other model types."""
    c = config.get("text_config", config)
    if c.get("model_type", config.get("model_type")) not in ESTIMATED_MODEL_TYPES:
        return None
    h, i, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    heads = c["num_attention_heads"]
    d = c.get("head_dim") or h // heads
    kv = c.get("num_key_value_heads") or heads
    shapes = [(heads * d, h), (kv * d, h), (kv * d, h), (h, heads * d), (i, h), (i, h), (h, i)]
    # No slack beyond the bound: the buffer is the weights' storage, and weight_bytes counts all of it.
    return layers * sum(_panel_bytes(n, k, element_size) for n, k in shapes) + _panel_bytes(c["vocab_size"], h, element_size)


def _panel_bytes(n: int, k: int, element_size: int) -> int:
    return -(-n // PANEL) * PANEL * k * element_size + ALIGN


class Prefault:
    """A huge-page buffer faulted in a thread (the kernel zeroes each fresh 2 MiB page: ~0.4 s for the bundled
    model's 257 MiB on 2 threads, a tenth of a cold start) while the main thread imports and loads the model."""

    def __init__(self, ext, nbytes: int):
        self.nbytes, self._buffer = nbytes, []
        self._thread = threading.Thread(target=lambda: self._buffer.append(ext.huge_page_buffer(nbytes)),
                                        name="pagedcore-huge-pages", daemon=True)
        self._thread.start()

    def take(self, nbytes: int) -> torch.Tensor | None:
        """The buffer if it holds nbytes and not much more (else None: the caller makes its own), once. Where the
        model packs fewer weights than its config's estimate (a linear left unpacked), a buffer far too large would
        hold that surplus for the engine's life: declined past max(SURPLUS_FRACTION, SURPLUS_BYTES)."""
        self._thread.join()
        buffer = self._buffer.pop() if self._buffer else None
        if buffer is None or buffer.numel() < nbytes:
            return None
        return buffer if buffer.numel() - nbytes <= max(SURPLUS_FRACTION * nbytes, SURPLUS_BYTES) else None


def prefault(config, device: torch.device, dtype: torch.dtype) -> Prefault | None:
    """Start faulting the buffer install() will fill, where the engine packs plain weights of an estimable model on
    the CPU; None elsewhere (install then allocates it itself)."""
    if device.type != "cpu" or not config.pack_weights or config.tensor_parallel_size != 1 or config.quantization \
            or dtype not in (torch.bfloat16, torch.float32):
        return None
    from pagedcore.model_loader import resolve_model_dir

    try:
        hf_config = json.loads((Path(resolve_model_dir(config.model)) / "config.json").read_text())
        nbytes = estimate_bytes(hf_config, torch.finfo(dtype).bits // 8)
    except (OSError, ValueError, KeyError, TypeError):
        return None  # the loader reports a bad model itself
    ext = cpu_ext.load()
    if nbytes is None or nbytes < MIN_BYTES or ext is None or not hasattr(ext, "huge_page_buffer"):
        return None
    return Prefault(ext, nbytes)


def _layout(by_storage: dict[int, list[torch.Tensor]]) -> tuple[dict[int, int], int]:
    """Each storage's offset in one buffer (ALIGN apart) and the buffer's bytes."""
    offsets, total = {}, 0
    for ptr, ts in by_storage.items():
        offsets[ptr] = total
        total += (ts[0].untyped_storage().nbytes() + ALIGN - 1) // ALIGN * ALIGN
    return offsets, total


def _fill(buffer: torch.Tensor, by_storage: dict[int, list[torch.Tensor]], offsets: dict[int, int]) -> None:
    """Copy each storage to its offset and point every tensor on it there, in place (`Tensor.set_`)."""
    storage = buffer.untyped_storage()
    for ptr, ts in by_storage.items():
        off, n = offsets[ptr], ts[0].untyped_storage().nbytes()
        buffer[off:off + n].copy_(torch.empty(0, dtype=torch.uint8).set_(ts[0].untyped_storage()))
        for t in ts:
            size = t.element_size()
            with torch.no_grad():
                t.set_(storage, off // size + t.storage_offset(), t.size(), t.stride())


def adopt(tensors: list[torch.Tensor]) -> int:
    """Move tensors that own their storage whole (contiguous, made by the engine) into one huge-page buffer, in place;
    returns the bytes moved (0 where too small or no C++ ops)."""
    ext = cpu_ext.load()
    by_storage = {t.untyped_storage().data_ptr(): [t] for t in tensors
                  if t.device.type == "cpu" and t.is_contiguous() and t.storage_offset() == 0
                  and t.untyped_storage().nbytes() == t.nbytes}
    offsets, total = _layout(by_storage)
    if total < MIN_BYTES or ext is None or not hasattr(ext, "huge_page_buffer"):
        return 0
    _fill(ext.huge_page_buffer(total), by_storage, offsets)
    return total


def install(model: nn.Module, device: torch.device, prefaulted: Prefault | None = None) -> int:
    """Move the packed weights of `model` into huge pages (into `prefaulted`'s buffer where it is large enough);
    returns the bytes moved (0: nothing done)."""
    ext = cpu_ext.load() if device.type == "cpu" else None
    if ext is None or not hasattr(ext, "huge_page_buffer"):
        return 0
    by_storage: dict[int, list[torch.Tensor]] = {}
    for t in packed_tensors(model):
        by_storage.setdefault(t.untyped_storage().data_ptr(), []).append(t)
    offsets, total = _layout(by_storage)
    if total < MIN_BYTES:
        return 0
    buffer = prefaulted.take(total) if prefaulted is not None else None
    if buffer is None:
        buffer = ext.huge_page_buffer(total)
    _fill(buffer, by_storage, offsets)
    logger.info("packed weights in huge pages: %.1f MiB in %d storages", total / 2**20, len(by_storage))
    return total

"""LoRAManager: adapters held in CPU memory, max_loras of them in the device slots, swapped in LRU.

An adapter is loaded once (`add_lora`) and stays in CPU memory until `remove_lora`. A step's
adapters (at most max_loras: the scheduler sees to it) are given slots before the forward; a slot
held by an adapter the step does not use is reused least recently used first.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict

import torch

from pagedcore.lora import layers, punica
from pagedcore.lora.peft_adapter import LoRALoadError, LoRAModel, load_peft_adapter
from pagedcore.lora.request import LoRARequest, UnknownLoRAError

logger = logging.getLogger("pagedcore")


class LoRAManager:
    def __init__(self, model: torch.nn.Module, max_loras: int, max_rank: int, device: torch.device,
                 dtype: torch.dtype):
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.dtype = dtype
        self.slots = layers.install(model, max_loras, max_rank, device, dtype)
        if not self.slots:
            raise ValueError(f"enable_lora: {type(model).__name__} has no linear layer named like "
                             f"{', '.join(layers.TARGET_MODULES)}; LoRA cannot be served on it")
        self.shapes = {name: (s.a.shape[2], s.b.shape[1]) for name, s in self.slots.items()}
        self.adapters: dict[str, LoRAModel] = {}  # by name, in CPU memory
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # adapter uid -> slot, least recently used first
        self._lock = threading.Lock()  # doors load and unload from their own threads

    # ---- the registry -------------------------------------------------------------------------
    def add_lora(self, request: LoRARequest) -> LoRAModel:
        """Load (or return the already loaded) adapter; a request with another id or path under a
        held name is refused."""
        held = self.adapters.get(request.lora_name)
        if held is not None:
            if request.lora_path not in (None, held.path) or request.lora_int_id != held.int_id:
                raise LoRALoadError(f"LoRA adapter {request.lora_name!r} is already loaded with lora_int_id "
                                    f"{held.int_id} from {held.path!r}; remove it first to load another")
            return held
        if request.lora_path is None:
            raise UnknownLoRAError(request.lora_name, list(self.adapters))
        lora = load_peft_adapter(request, self.shapes, self.max_rank, self.dtype)
        with self._lock:
            clash = [a.name for a in self.adapters.values() if a.int_id == lora.int_id]
            if clash:
                raise LoRALoadError(f"lora_int_id {lora.int_id} is already used by LoRA adapter {clash[0]!r}")
            self.adapters.setdefault(lora.name, lora)
        logger.info("LoRA adapter %r loaded: rank %d, %d layers, from %s", lora.name, lora.rank, len(lora.weights),
                    lora.path)
        return self.adapters[lora.name]

    def remove_lora(self, name: str) -> bool:
        """Forget an adapter: new requests cannot use it; requests already running under it finish."""
        with self._lock:
            return self.adapters.pop(name, None) is not None

    def get(self, name: str) -> LoRAModel | None:
        return self.adapters.get(name)

    def list_loras(self) -> list[LoRAModel]:
        return list(self.adapters.values())

    # ---- one step -------------------------------------------------------------------------------
    def prepare(self, loras: list[LoRAModel | None], tokens_per_seq: list[int],
                device: torch.device) -> punica.LoRAMapping | None:
        """Give the step's adapters slots (swapping in from CPU memory as needed); its mapping."""
        if all(lora is None for lora in loras):
            return None
        needed = {lora.uid: lora for lora in loras if lora is not None}
        if len(needed) > self.max_loras:
            raise RuntimeError(f"a step holds {len(needed)} adapters, over max_loras ({self.max_loras})")
        slot_of_uid = {uid: self._activate(lora, needed) for uid, lora in needed.items()}
        return punica.make_mapping([-1 if lora is None else slot_of_uid[lora.uid] for lora in loras],
                                   tokens_per_seq, device)

    def _activate(self, lora: LoRAModel, in_use: dict) -> int:
        slot = self.slot_of.get(lora.uid)
        if slot is not None:
            self.slot_of.move_to_end(lora.uid)
            return slot
        taken = set(self.slot_of.values())
        free = [s for s in range(self.max_loras) if s not in taken]
        if free:
            slot = free[0]
        else:  # evict the least recently used adapter this step does not need
            uid = next(u for u in self.slot_of if u not in in_use)  # exists: the step holds <= max_loras
            slot = self.slot_of.pop(uid)
        for name, buffers in self.slots.items():
            buffers.set(slot, lora.weights.get(name))
        self.slot_of[lora.uid] = slot
        return slot

"""LLMEngine's LoRA adapter methods (vLLM's names), over its registry (pagedcore/lora/registry.py) and runner."""

from __future__ import annotations


class LoRAEngineAPI:
    """Mixed into LLMEngine, which sets `loras` (a LoRARegistry) and `runner`."""

    @property
    def lora_manager(self):
        return self.runner.lora_manager

    def add_lora(self, lora_request) -> bool:
        """Load a PEFT adapter into CPU memory (from any thread); True once it is held. A bad one raises
        LoRALoadError (an InvalidRequestError) naming what is and is not supported."""
        return self.loras.add_lora(lora_request)

    def remove_lora(self, lora_name: str) -> bool:
        """Forget an adapter: new requests cannot name it, running ones finish; False if it was not held."""
        return self.loras.remove_lora(lora_name)

    def list_loras(self) -> list:
        """The held adapters (LoRAModel: name, int_id, path, rank)."""
        return self.loras.list_loras()

    def resolve_lora(self, lora_request):
        """The LoRAModel a request runs under (None: the base model). A LoRARequest's adapter is loaded
        on first use from its path and found by name after; a plain name (the doors') must be held.
        Unknown names raise UnknownLoRAError."""
        return self.loras.resolve(lora_request)

    def next_lora_int_id(self) -> int:
        """An id no held adapter uses (for adapters loaded by name and path alone, e.g. through a door)."""
        return self.loras.next_int_id()

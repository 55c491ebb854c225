"""LoRARegistry: the engine's adapter methods (vLLM's names: add_lora, remove_lora, list_loras), by name.

It wraps the runner's LoRAManager, or none when the engine runs without LoRA: then listing finds
nothing and a request naming an adapter is refused, saying how to turn LoRA on.
"""

from __future__ import annotations

from pagedcore.lora.request import LoRARequest, UnknownLoRAError
from pagedcore.sampling_params import InvalidRequestError


class LoRARegistry:
    def __init__(self, manager):
        self.manager = manager  # LoRAManager, or None: LoRA off

    def load_modules(self, lora_modules: dict[str, str] | None) -> None:
        """The adapters named at start (EngineConfig.lora_modules: name -> path), ids from 1."""
        for i, (name, path) in enumerate((lora_modules or {}).items(), start=1):
            self.add_lora(LoRARequest(name, i, path))

    def add_lora(self, lora_request) -> bool:
        return self.resolve(lora_request) is not None

    def remove_lora(self, lora_name: str) -> bool:
        return self.manager is not None and self.manager.remove_lora(lora_name)

    def list_loras(self) -> list:
        return [] if self.manager is None else self.manager.list_loras()

    def resolve(self, lora_request):
        """The LoRAModel a request runs under (None: the base model); see LLMEngine.resolve_lora."""
        if lora_request is None:
            return None
        from pagedcore.lora.peft_adapter import LoRAModel  # loaded only once a request names an adapter

        if isinstance(lora_request, LoRAModel):
            return lora_request
        if not isinstance(lora_request, (LoRARequest, str)):
            raise InvalidRequestError(f"lora_request must be a LoRARequest or an adapter name, got "
                                      f"{type(lora_request).__name__}", "lora_request")
        name = lora_request if isinstance(lora_request, str) else lora_request.lora_name
        if self.manager is None:
            raise InvalidRequestError(f"LoRA adapter {name!r} requested, but the engine runs without LoRA (start "
                                      "it with enable_lora=True)", "lora_request")
        if isinstance(lora_request, str):
            lora = self.manager.get(name)
            if lora is None:
                raise UnknownLoRAError(name, [a.name for a in self.list_loras()])
            return lora
        return self.manager.add_lora(lora_request)

    def next_int_id(self) -> int:
        """An id no held adapter uses (for adapters loaded by name and path alone, e.g. through a door)."""
        return max((a.int_id for a in self.list_loras()), default=0) + 1

"""LoRARequest: which adapter a request runs under (vLLM's class and field names)."""

from __future__ import annotations

from dataclasses import dataclass

from pagedcore.sampling_params import InvalidRequestError


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str  # what requests and the OpenAI `model` field call it
    lora_int_id: int  # a positive integer of the caller's choosing (vLLM's), unique per adapter
    lora_path: str | None = None  # a PEFT directory; None: an adapter the engine already holds by this name

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")


class UnknownLoRAError(InvalidRequestError):
    """A request names an adapter the engine does not hold (the doors answer 404 / INVALID_ARG)."""

    def __init__(self, name: str, loaded: list[str]):
        held = ", ".join(repr(n) for n in loaded) or "none"
        super().__init__(f"unknown LoRA adapter {name!r} (loaded adapters: {held})", "lora_request")
        self.lora_name = name

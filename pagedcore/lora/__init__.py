"""Multi-LoRA serving: PEFT adapters over one base model, mixed per token in one batch (README "LoRA adapters")."""

from pagedcore.lora.request import LoRARequest, UnknownLoRAError

__all__ = ["LoRARequest", "UnknownLoRAError"]

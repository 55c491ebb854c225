"""PEFT adapters made locally for the LoRA tests, and PEFT's own greedy output as the reference."""

from __future__ import annotations

from pathlib import Path

import torch

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]


def make_peft_adapter(model_dir, out: Path, seed: int, r: int, target_modules: list[str], lora_alpha: int,
                      use_rslora: bool = False, std: float = 0.05) -> Path:
    """A PEFT LoRA adapter for `model_dir` with random non-zero A and B (PEFT starts B at zero,
    which would make the adapter the base model)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    cfg = LoraConfig(r=r, lora_alpha=lora_alpha, target_modules=target_modules, use_rslora=use_rslora,
                     lora_dropout=0.0, task_type="CAUSAL_LM")
    model = get_peft_model(base, cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    model.save_pretrained(str(out))
    return out


def peft_model(model_dir, adapter_dir):
    """The base model with the adapter, as PEFT runs it (fp32, eval)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    return PeftModel.from_pretrained(base, str(adapter_dir)).eval()

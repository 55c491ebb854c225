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


def lora_requests(adapters: dict[str, Path]) -> dict:
    """A LoRARequest per adapter, ids from 1 in order."""
    from pagedcore.lora import LoRARequest

    return {name: LoRARequest(name, i, str(path)) for i, (name, path) in enumerate(adapters.items(), start=1)}


def peft_references(model_dir, adapters: dict[str, Path], prompts: list[list[int]], max_new: int) -> dict:
    """PEFT's greedy tokens and logprobs per adapter (None: the base model) and prompt."""
    from conftest import hf_greedy
    from transformers import AutoModelForCausalLM

    refs = {None: [hf_greedy(AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32), p, max_new)
                   for p in prompts]}
    for name, path in adapters.items():
        model = peft_model(model_dir, path)
        refs[name] = [hf_greedy(model, p, max_new) for p in prompts]
        del model
    return refs


# ---- the front doors' LoRA tests (test_lora_openai.py, test_lora_triton.py) ------------------------------
def door_adapters(model_dir, out: Path) -> dict[str, Path]:
    """The two adapters a door serves: "a" on the attention, "b" on the MLP, other ranks and scales."""
    return {"a": make_peft_adapter(model_dir, out / "a", seed=1, r=8, target_modules=ATTENTION, lora_alpha=16,
                                   std=0.2),
            "b": make_peft_adapter(model_dir, out / "b", seed=2, r=4, target_modules=MLP, lora_alpha=8, std=0.2)}


def offline_texts(model_dir, settings: dict, adapters: dict[str, Path], prompt: str, params) -> dict:
    """The offline engine's text per adapter (None: the base model) under the door's settings: what the
    door must return."""
    from pagedcore import LLM

    llm = LLM(str(model_dir), **settings)
    reqs = {None: None, **lora_requests(adapters)}
    return {name: llm.generate([prompt], params, use_tqdm=False, lora_request=r)[0].outputs[0].text
            for name, r in reqs.items()}

"""Write a random LoRA adapter in PEFT's format for a model (default: the bundled SmolLM2), to try
multi-LoRA serving without downloading one:

    .venv/bin/python examples/lora_random_adapter.py /tmp/demo-lora [--rank 8] [--model HF_DIR]

Real adapters come from PEFT's `save_pretrained` (adapter_config.json + adapter_model.safetensors).
"""

import argparse
from pathlib import Path

from transformers import AutoModelForCausalLM

from pagedcore.bench.lora import write_random_adapter
from pagedcore.model_loader import resolve_model_dir

ap = argparse.ArgumentParser()
ap.add_argument("out")
ap.add_argument("--rank", type=int, default=8)
ap.add_argument("--model", default=None)
ap.add_argument("--seed", type=int, default=0)
args = ap.parse_args()
model = AutoModelForCausalLM.from_pretrained(str(resolve_model_dir(args.model)))
print(write_random_adapter(model, Path(args.out), args.rank, args.seed, std=0.05))

"""A pre-quantized HF checkpoint as a model: the dense skeleton from config.json, each quantized
linear replaced by a module over the checkpoint's own codes, everything else loaded as is.

Shared by the formats (compressed_tensors.py, gptq.py, awq.py): each names the tensor that marks a
quantized linear (`weight_packed`, `qweight`) and builds the module from that linear's tensors.
Nothing is ever de-quantized, so no dense copy of a quantized weight exists at any time.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Callable

import torch
from torch import nn

# (module name, {tensor suffix: tensor} of that module, incl. "bias" when present) -> the module
BuildLinear = Callable[[str, dict[str, torch.Tensor]], nn.Module]


def quantization_config(model_dir: Path) -> dict | None:
    """config.json's `quantization_config` (its `quant_method` names the format), or None."""
    return json.loads((model_dir / "config.json").read_text()).get("quantization_config") or None


def read_state(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        state.update(load_file(str(f)))
    return state


def load(model_dir: Path, dtype: torch.dtype, marker: str, build: BuildLinear, fmt: str) -> nn.Module:
    """The HF model with every module that has a `<name>.<marker>` tensor built by `build`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model_dir))
    del config.quantization_config  # the dense skeleton: transformers must not de-quantize
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    state = read_state(model_dir)
    quantized = {k.rsplit(".", 1)[0] for k in state if k.endswith("." + marker)}
    parts: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)
    for key in [k for k in state if k.rsplit(".", 1)[0] in quantized]:
        name, suffix = key.rsplit(".", 1)
        parts[name][suffix] = state.pop(key)
    for name in sorted(quantized):
        linear = model.get_submodule(name)
        if not isinstance(linear, nn.Linear):
            raise ValueError(f"{name}: quantized weights for a {type(linear).__name__}, not a Linear")
        module = build(name, parts[name])
        if (module.in_features, module.out_features) != (linear.in_features, linear.out_features):
            raise ValueError(f"{name}: {fmt} weight is {module.out_features}x{module.in_features}, the model's "
                             f"Linear {linear.out_features}x{linear.in_features}")
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, module)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if m.rsplit(".", 1)[0] not in quantized]
    if model.config.tie_word_embeddings:
        missing = [m for m in missing if m != "lm_head.weight"]
        model.tie_weights()
    if missing or unexpected:
        raise ValueError(f"{fmt} checkpoint {model_dir}: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return model

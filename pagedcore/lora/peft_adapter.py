"""A PEFT LoRA adapter read from its directory (`adapter_config.json` + `adapter_model.safetensors`).

Read directly, without peft: the engine needs only the A/B matrices and PEFT's scaling rule,
`lora_alpha / r` (or `lora_alpha / sqrt(r)` with `use_rslora`), per module after `rank_pattern`
and `alpha_pattern`. The scale is folded into B once here, so a forward pays two matmuls and no
multiply. PEFT's `fan_in_fan_out` concerns only the base weight's layout (GPT-2's Conv1D);
lora_A and lora_B are plain Linear weights either way.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pagedcore.lora.request import LoRARequest
from pagedcore.sampling_params import InvalidRequestError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# PEFT's saved key: base_model.model.<module of the causal LM>.lora_A.weight (older files: .lora_A.<adapter>.weight)
_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$")
_uids = itertools.count(1)


class LoRALoadError(InvalidRequestError):
    """An adapter the engine cannot serve; the message names what is and is not supported."""

    def __init__(self, message: str):
        super().__init__(message, "lora_request")


@dataclass
class LoRAModel:
    name: str
    int_id: int
    path: str
    rank: int  # the largest rank over its modules
    # module name (as in model.named_modules()) -> (A [r, in], B [out, r] already multiplied by the scale)
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]
    # Unique per load: the prefix cache keys on it, so an adapter reloaded under the same name with
    # other weights never reuses the old one's KV.
    uid: int = field(default_factory=lambda: next(_uids))

    @property
    def cache_key(self) -> tuple:
        return ("lora", self.name, self.int_id, self.uid)


def load_peft_adapter(request: LoRARequest, shapes: dict[str, tuple[int, int]], max_rank: int,
                      dtype: torch.dtype) -> LoRAModel:
    """Read and check `request.lora_path` against the model's servable modules (`shapes`: module
    name -> (in_features, out_features)) and `max_rank`; the weights come back in `dtype` on the CPU."""
    path = Path(request.lora_path)
    cfg = _read_config(path, request.lora_name)
    tensors = _read_weights(path, request.lora_name)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    others = []
    for key, t in tensors.items():
        m = _KEY.match(key)
        if m is None:
            others.append(key)
        else:
            pairs.setdefault(m["module"], {})[m["ab"]] = t
    if not pairs:
        raise LoRALoadError(f"LoRA adapter {request.lora_name!r}: {WEIGHTS_FILE} holds no lora_A/lora_B weights")
    # The targets first: an unservable one (lm_head, embeddings) is the error to name.
    weights = {module: _module_weights(request.lora_name, module, ab, cfg, shapes, max_rank, dtype)
               for module, ab in pairs.items()}
    if others:
        raise LoRALoadError(f"LoRA adapter {request.lora_name!r}: tensor {others[0]!r} is not a lora_A/lora_B weight "
                            "of a linear layer (modules_to_save, saved embeddings, DoRA magnitudes are not supported)")
    rank = max(a.shape[0] for a, _ in weights.values())
    return LoRAModel(request.lora_name, request.lora_int_id, str(path), rank, weights)


def _read_config(path: Path, name: str) -> dict:
    file = path / CONFIG_FILE
    if not file.is_file():
        raise LoRALoadError(f"LoRA adapter {name!r}: no {CONFIG_FILE} in {str(path)!r} (a PEFT adapter directory is needed)")
    cfg = json.loads(file.read_text())
    if cfg.get("peft_type", "LORA") != "LORA":
        raise LoRALoadError(f"LoRA adapter {name!r}: peft_type {cfg.get('peft_type')!r}; only LORA adapters are supported")
    for key, ok in (("use_dora", False), ("bias", "none")):
        if cfg.get(key, ok) not in (ok, None):
            raise LoRALoadError(f"LoRA adapter {name!r}: {key}={cfg[key]!r} is not supported (only {key}={ok!r})")
    return cfg


def _read_weights(path: Path, name: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    file = path / WEIGHTS_FILE
    if not file.is_file():
        other = " (adapter_model.bin is not read: save with safe_serialization)" if (path / "adapter_model.bin").exists() else ""
        raise LoRALoadError(f"LoRA adapter {name!r}: no {WEIGHTS_FILE} in {str(path)!r}{other}")
    return load_file(str(file))


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's rank_pattern / alpha_pattern: a key matches the module name or its dotted suffix."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?{key}$", module):
            return value
    return default


def _module_weights(name: str, module: str, ab: dict, cfg: dict, shapes: dict, max_rank: int, dtype: torch.dtype):
    if module not in shapes:
        kinds = sorted({m.rsplit(".", 1)[-1] for m in shapes})
        raise LoRALoadError(f"LoRA adapter {name!r}: target module {module!r} cannot be served; supported are the "
                            f"attention and MLP projections of the decoder layers ({', '.join(kinds)})")
    if set(ab) != {"A", "B"}:
        raise LoRALoadError(f"LoRA adapter {name!r}: module {module!r} has lora_{''.join(ab)} but not both A and B")
    a, b = ab["A"], ab["B"]
    in_features, out_features = shapes[module]
    r = a.shape[0]
    if a.shape != (r, in_features) or b.shape != (out_features, r):
        raise LoRALoadError(f"LoRA adapter {name!r}: module {module!r} has lora_A {tuple(a.shape)} and lora_B "
                            f"{tuple(b.shape)}; the model's layer needs [r, {in_features}] and [{out_features}, r]")
    if r > max_rank:
        raise LoRALoadError(f"LoRA adapter {name!r}: rank {r} (module {module!r}) is over max_lora_rank {max_rank}; "
                            "start the engine with a larger max_lora_rank")
    alpha = _pattern_value(cfg.get("alpha_pattern"), module, cfg.get("lora_alpha", 8))
    scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    return a.to(dtype).contiguous(), (b.float() * scale).to(dtype).contiguous()

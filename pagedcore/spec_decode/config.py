"""SpeculativeConfig: `EngineConfig.speculative_config` (a dict, vLLM's keys) checked once."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

METHODS = ("ngram", "draft_model", "layer_skip")


@dataclass
class SpeculativeConfig:
    method: str  # "ngram" | "draft_model" | "layer_skip"
    num_speculative_tokens: int  # k: drafts proposed per sequence and step
    prompt_lookup_max: int | None = None  # ngram: longest suffix looked up (default 4)
    prompt_lookup_min: int | None = None  # ngram: shortest (default 1)
    model: str | None = None  # draft_model: HF directory or .gguf sharing the target's tokenizer
    num_layers: int | None = None  # layer_skip: the target's first N layers (default: a quarter)
    # Speculate only while fewer sequences run; None: decided from the verify/decode cost measured at
    # start-up and the acceptance measured since (vLLM's name for the fixed form).
    disable_by_batch_size: int | None = None
    draft_num_kv_blocks: int | None = None  # the draft's KV pool; None: as many blocks as the target's

    @classmethod
    def from_dict(cls, d: dict | SpeculativeConfig) -> SpeculativeConfig:
        if isinstance(d, SpeculativeConfig):
            return d
        if not isinstance(d, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(d).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {unknown} (known: {sorted(names)})")
        for key in ("method", "num_speculative_tokens"):
            if key not in d:
                raise ValueError(f"speculative_config needs {key!r}")
        config = cls(**d)
        config.validate()
        return config

    def validate(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config method must be one of {METHODS}, got {self.method!r}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"speculative_config num_speculative_tokens must be an int >= 1, got {k!r}")
        if self.method == "ngram":
            self.prompt_lookup_max = 4 if self.prompt_lookup_max is None else self.prompt_lookup_max
            self.prompt_lookup_min = 1 if self.prompt_lookup_min is None else self.prompt_lookup_min
            if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
                raise ValueError("speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                                 f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative_config method 'draft_model' needs 'model' (an HF directory or .gguf)")
        if self.method == "layer_skip" and self.num_layers is not None and self.num_layers < 1:
            raise ValueError(f"speculative_config num_layers must be >= 1, got {self.num_layers}")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError(f"speculative_config disable_by_batch_size must be >= 1, got {self.disable_by_batch_size}")

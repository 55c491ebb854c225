"""SamplingParams: what a request asks of the sampler, validated once at admission."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from pagedcore.structured_output.params import StructuredOutputsParams


class InvalidRequestError(ValueError):
    """A request the engine refuses; `field` names the offending input."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


_EPS = 1e-5


@dataclass
class SamplingParams:
    n: int = 1
    best_of: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the model's context
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per sampled token (0: only the sampled one)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Beam search, run in the engine core (beam_search.py).
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    # Constrained decoding (vLLM's names): {"json": schema} | {"regex": str} | {"choice": [...]} |
    # {"grammar": ebnf} | {"json_object": True}; see pagedcore/structured_output/.
    structured_outputs: StructuredOutputsParams | dict | None = None
    logit_bias: dict[int, float] | None = None  # token id -> bias added to its logit, in [-100, 100] (OpenAI)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.logit_bias, dict):  # from JSON the token ids are strings ("123"), as OpenAI sends them
            self.logit_bias = {int(t) if isinstance(t, str) and t.isdigit() else t: b for t, b in self.logit_bias.items()}
        if self.structured_outputs is not None:
            try:
                self.structured_outputs = StructuredOutputsParams.from_value(self.structured_outputs)
            except (ValueError, TypeError) as e:
                raise InvalidRequestError(str(e), "structured_outputs") from e
        self._validate()

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SamplingParams":
        """Build from user JSON; unknown keys are an error naming the key."""
        if not isinstance(d, dict):
            raise InvalidRequestError("sampling parameters must be a JSON object", "sampling_params")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise InvalidRequestError(f"unknown sampling parameter(s): {', '.join(unknown)}", unknown[0])
        try:
            return cls(**d)
        except TypeError as e:  # wrong types reaching comparisons
            raise InvalidRequestError(f"invalid sampling parameters: {e}", "sampling_params") from e

    @property
    def argmax_only(self) -> bool:
        """Only the argmax of the logits is needed: one greedy sample, no logprobs, nothing that edits the logits.
        Such a request reports no cumulative logprob (as vLLM v1): its logits may never all be computed
        (pagedcore/greedy_head.py); logprobs=0 asks for it."""
        return (self.greedy and self.n == 1 and (self.best_of or 1) == 1 and self.logprobs is None
                and not self.use_beam_search and self.repetition_penalty == 1.0 and self.presence_penalty == 0.0
                and self.frequency_penalty == 0.0 and not self.logit_bias and self.min_tokens == 0
                and self.structured_outputs is None)

    @property
    def greedy(self) -> bool:
        return self.temperature < _EPS

    def _check(self, ok: bool, name: str, why: str) -> None:
        if not ok:
            raise InvalidRequestError(f"{name} {why}, got {getattr(self, name)!r}", name)

    def _validate(self) -> None:
        num = (int, float)
        self._check(isinstance(self.n, int) and self.n >= 1, "n", "must be an integer >= 1")
        if self.best_of is not None:
            self._check(isinstance(self.best_of, int) and self.best_of >= self.n, "best_of", "must be an integer >= n")
        self._check(isinstance(self.temperature, num) and self.temperature >= 0, "temperature", "must be >= 0")
        self._check(isinstance(self.top_p, num) and 0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        self._check(isinstance(self.top_k, int) and self.top_k >= 0, "top_k", "must be 0/-1 (disabled) or >= 1")
        self._check(isinstance(self.min_p, num) and 0 <= self.min_p <= 1, "min_p", "must be in [0, 1]")
        self._check(isinstance(self.repetition_penalty, num) and self.repetition_penalty > 0,
                    "repetition_penalty", "must be > 0")
        self._check(isinstance(self.presence_penalty, num) and -2 <= self.presence_penalty <= 2,
                    "presence_penalty", "must be in [-2, 2]")
        self._check(isinstance(self.frequency_penalty, num) and -2 <= self.frequency_penalty <= 2,
                    "frequency_penalty", "must be in [-2, 2]")
        self._check(self.seed is None or (isinstance(self.seed, int) and -2**63 <= self.seed < 2**63), "seed",
                    "must be a 64-bit integer")
        self._check(self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
                    "max_tokens", "must be an integer >= 1")
        self._check(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens", "must be >= 0")
        if self.max_tokens is not None:
            self._check(self.min_tokens <= self.max_tokens, "min_tokens", "must be <= max_tokens")
        self._check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        self._check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
                    "stop_token_ids", "must be non-negative integers")
        self._check(self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20),
                    "logprobs", "must be an integer in [0, 20]")
        self._check(isinstance(self.length_penalty, num), "length_penalty", "must be a number")
        self._check(self.early_stopping in (True, False, "never"), "early_stopping", "must be true, false or 'never'")
        if self.use_beam_search:
            self._check(not self.stop, "stop", "is not supported with beam search")
            self._check(self.structured_outputs is None, "structured_outputs", "is not supported with beam search")
        if self.logit_bias is not None:
            self._check(isinstance(self.logit_bias, dict) and all(
                isinstance(t, int) and t >= 0 and isinstance(b, (int, float)) and -100 <= b <= 100
                for t, b in self.logit_bias.items()), "logit_bias",
                "must map token ids (integers >= 0) to biases in [-100, 100]")

    def validate_vocab(self, vocab_size: int) -> None:
        bad = [t for t in self.stop_token_ids if t >= vocab_size]
        if bad:
            raise InvalidRequestError(f"stop_token_ids {bad} outside the vocabulary ({vocab_size})", "stop_token_ids")
        bad = [t for t in self.logit_bias or {} if t >= vocab_size]
        if bad:
            raise InvalidRequestError(f"logit_bias token ids {bad[:5]} outside the vocabulary ({vocab_size})",
                                      "logit_bias")

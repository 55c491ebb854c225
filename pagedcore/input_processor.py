"""InputProcessor: a request's intake (vLLM's Processor): validate and tokenize its prompt, check its
sampling parameters and options against the engine's limits.

Pure: it touches no engine state, so the doors run it in their own threads before queueing. It only
raises (InvalidRequestError, LimitExceededError naming the field); the engine counts the refusals.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedcore.config import EngineConfig
from pagedcore.limits import LimitExceededError, load_json
from pagedcore.sampling_params import InvalidRequestError, SamplingParams


@dataclass
class ProcessedPrompt:
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams


class InputProcessor:
    def __init__(self, config: EngineConfig, tokenizer, vocab_size: int, max_model_len: int, num_kv_tokens: int,
                 policy):
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.num_kv_tokens = num_kv_tokens  # the KV cache's size in tokens
        self.policy = policy

    def max_token_capacity(self) -> int:
        cap = min(self.max_model_len, self.num_kv_tokens)
        if not self.config.enable_chunked_prefill:
            # A (re)prefill must fit one step's budget, or the sequence would wait forever.
            cap = min(cap, self.config.max_num_batched_tokens)
        return cap

    def max_total_tokens(self) -> int:
        """A sequence's cap: prompt and output tokens together."""
        cap = self.max_token_capacity()
        return cap if self.config.max_total_tokens is None else min(cap, self.config.max_total_tokens)

    # ---- the prompt ---------------------------------------------------------------------------
    def process_prompt(self, prompt, params) -> ProcessedPrompt:
        params = self.check_params(params)
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt is empty", "prompt")
            size = len(prompt.encode("utf-8", "surrogatepass"))
            if size > self.config.payload_limit:  # before tokenizing it: that is what costs
                raise LimitExceededError(f"prompt has {size} bytes, over payload_limit ({self.config.payload_limit})",
                                         "prompt", "payload_limit")
            text, ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            text, ids = None, list(prompt)
            self._check_input_tokens(ids)  # before the vocabulary scan
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidRequestError(f"prompt token ids {bad[:5]} outside the vocabulary ({self.vocab_size})", "prompt")
        else:
            raise InvalidRequestError("prompt must be a string or a list of token ids", "prompt")
        if not ids:
            raise InvalidRequestError("prompt is empty", "prompt")
        self._check_input_tokens(ids)
        self._check_total_tokens(len(ids), params)
        return ProcessedPrompt(text, ids, params)

    def _check_input_tokens(self, ids: list[int]) -> None:
        limit = self.max_token_capacity() - 1
        if self.config.max_input_tokens is not None and self.config.max_input_tokens < limit:
            if len(ids) > self.config.max_input_tokens:
                raise LimitExceededError(f"prompt has {len(ids)} tokens, over max_input_tokens "
                                         f"({self.config.max_input_tokens})", "prompt", "max_input_tokens")
        elif len(ids) > limit:
            raise LimitExceededError(
                f"prompt has {len(ids)} tokens, but at most {limit} fit (max_model_len {self.max_model_len}, "
                f"KV cache {self.num_kv_tokens} tokens"
                + ("" if self.config.max_total_tokens is None else f", max_total_tokens {self.config.max_total_tokens}")
                + ("" if self.config.enable_chunked_prefill else
                   f", max_num_batched_tokens {self.config.max_num_batched_tokens} without chunked prefill")
                + ") leaving room for one new token",
                "prompt", "max_input_tokens")

    def _check_total_tokens(self, num_prompt: int, params: SamplingParams) -> None:
        """Set, max_total_tokens refuses a larger prompt + max_tokens (TGI); unset, max_tokens is only
        capped at the context (finish "length"), as before."""
        limit = self.config.max_total_tokens
        if limit is not None and params.max_tokens is not None and num_prompt + params.max_tokens > limit:
            raise LimitExceededError(
                f"max_tokens {params.max_tokens} with a prompt of {num_prompt} tokens is {num_prompt + params.max_tokens} "
                f"tokens, over max_total_tokens ({limit})", "max_tokens", "max_total_tokens")

    # ---- parameters and options ---------------------------------------------------------------------
    def check_params(self, params) -> SamplingParams:
        if params is None:
            params = SamplingParams()
        elif isinstance(params, dict):
            params = SamplingParams.from_dict(params)
        elif not isinstance(params, SamplingParams):
            raise InvalidRequestError("sampling params must be SamplingParams or a dict", "sampling_params")
        params.validate_vocab(self.vocab_size)
        c = self.config
        width = params.best_of or params.n
        if width > c.max_best_of:
            name = "best_of" if params.best_of else "n"
            raise LimitExceededError(f"{name} {width} is over max_best_of ({c.max_best_of})", name, "max_best_of")
        for name in ("stop", "stop_token_ids"):
            if len(getattr(params, name)) > c.max_stop_sequences:
                raise LimitExceededError(f"{name} has {len(getattr(params, name))} entries, over max_stop_sequences "
                                         f"({c.max_stop_sequences})", name, "max_stop_sequences")
        return params

    def check_request_options(self, priority, cache_salt) -> None:
        """The per-request options beside the sampling parameters (vLLM's `priority`, `cache_salt`)."""
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise InvalidRequestError(f"cache_salt must be a non-empty string, got {cache_salt!r}", "cache_salt")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise InvalidRequestError(f"priority must be an integer, got {priority!r}", "priority")
        if priority and not getattr(self.policy, "uses_priority", False):
            raise InvalidRequestError(
                f"priority {priority} given, but the scheduling policy {self.config.scheduling_policy!r} ignores "
                "priorities (start the engine with scheduling_policy='priority')", "priority")

    # ---- the raw request ----------------------------------------------------------------------------
    def load_json(self, raw: str | bytes, field: str | None = None) -> object:
        return load_json(raw, field, self.config.payload_limit, self.config.max_json_depth)

    def check_payload(self, num_bytes: int, field: str | None = None) -> None:
        if num_bytes > self.config.payload_limit:
            raise LimitExceededError(f"{field or 'the request body'} has {num_bytes} bytes, over payload_limit "
                                     f"({self.config.payload_limit})", field, "payload_limit")

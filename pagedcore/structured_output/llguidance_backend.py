"""The optional second backend: llguidance (`structured_outputs_backend="llguidance"`)."""

from __future__ import annotations

import json

import llguidance
import llguidance.hf
import llguidance.torch
import torch

from pagedcore.structured_output.backend import MatcherGrammar, StructuredOutputBackend
from pagedcore.structured_output.params import StructuredOutputsParams

_COMPACT = {"whitespace_flexible": False}  # as xgrammar's any_whitespace=False: no stalling in spaces


class LLGuidanceGrammar(MatcherGrammar):
    matcher: llguidance.LLMatcher

    def _accept_token(self, token_id: int) -> bool:
        return self.matcher.consume_token(token_id) and not self.matcher.is_error()

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        llguidance.torch.fill_next_token_bitmask(self.matcher, bitmask, row)

    def is_terminated(self) -> bool:
        return self.matcher.is_stopped()

    def _fork_matcher(self) -> llguidance.LLMatcher:
        return self.matcher.deep_copy()


class LLGuidanceBackend(StructuredOutputBackend):
    name = "llguidance"

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]):
        super().__init__(tokenizer, vocab_size, stop_token_ids)
        self.ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=stop_token_ids)

    def compile(self, spec: StructuredOutputsParams) -> str:
        kind = spec.kind
        try:
            grammar = self._grammar(spec)
        except ValueError as e:
            raise ValueError(f"structured_outputs.{kind} does not compile: {e}") from e
        error = llguidance.LLMatcher.validate_grammar(grammar, self.ll_tokenizer)
        if error:
            raise ValueError(f"structured_outputs.{kind} does not compile: {error.strip().splitlines()[0]}")
        return grammar

    @staticmethod
    def _grammar(spec: StructuredOutputsParams) -> str:
        kind = spec.kind
        if kind == "json":
            return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(spec.schema), defaults=_COMPACT)
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=_COMPACT)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec.regex)
        if kind == "choice":
            return llguidance.LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice))
        return llguidance.grammar_from("grammar", spec.grammar)

    def matcher(self, compiled: str) -> LLGuidanceGrammar:
        return LLGuidanceGrammar(llguidance.LLMatcher(self.ll_tokenizer, compiled))

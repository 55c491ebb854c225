"""The built-in backend: xgrammar (bitmask fill and apply in C++, on the CPU)."""

from __future__ import annotations

import json

import torch
import xgrammar as xgr

from pagedcore.structured_output.backend import MatcherGrammar, StructuredOutputBackend, choice_ebnf
from pagedcore.structured_output.params import StructuredOutputsParams


class XGrammarGrammar(MatcherGrammar):
    matcher: xgr.GrammarMatcher

    def _accept_token(self, token_id: int) -> bool:
        return self.matcher.accept_token(token_id)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def _fork_matcher(self) -> xgr.GrammarMatcher:
        return self.matcher.fork()


class XGrammarBackend(StructuredOutputBackend):
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]):
        super().__init__(tokenizer, vocab_size, stop_token_ids)
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)  # the manager caches
        self.batch = xgr.BatchGrammarMatcher(max_threads=1)

    def compile(self, spec: StructuredOutputsParams) -> xgr.CompiledGrammar:
        kind = spec.kind
        try:
            if kind == "json":
                # No arbitrary whitespace: small models otherwise stall emitting spaces.
                schema = _escaped_bounded_strings(spec.schema)
                return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
            if kind == "json_object":
                return self.compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
            if kind == "regex":
                return self.compiler.compile_regex(spec.regex)
            if kind == "choice":
                return self.compiler.compile_grammar(choice_ebnf(spec.choice))
            return self.compiler.compile_grammar(spec.grammar)
        except (RuntimeError, ValueError) as e:
            raise ValueError(f"structured_outputs.{kind} does not compile: {_message(e)}") from e

    def matcher(self, compiled: xgr.CompiledGrammar) -> XGrammarGrammar:
        return XGrammarGrammar(xgr.GrammarMatcher(compiled))

    def fill_bitmask(self, grammars, bitmask, rows) -> None:
        self.batch.batch_fill_next_token_bitmask([g.matcher for g in grammars], bitmask, rows)


def _escaped_bounded_strings(node):
    """xgrammar 0.2.8 lets raw control characters into strings with minLength / maxLength (invalid
    JSON); the same bounds as a pattern over the characters JSON allows unescaped keep it valid."""
    if isinstance(node, list):
        return [_escaped_bounded_strings(x) for x in node]
    if not isinstance(node, dict):
        return node
    node = {k: _escaped_bounded_strings(v) for k, v in node.items()}
    types = node.get("type")
    is_string = types == "string" or isinstance(types, list) and "string" in types
    if is_string and ("minLength" in node or "maxLength" in node) and "pattern" not in node and "format" not in node:
        low, high = node.pop("minLength", 0), node.pop("maxLength", "")
        node["pattern"] = f'^[^"\\\\\\x00-\\x1f]{{{low},{high}}}$'
    return node


def _message(e: Exception) -> str:
    """xgrammar prefixes its C++ errors with '[time] file:line: '; keep the message."""
    text = str(e).strip()
    return text.split(": ", 1)[1] if text.startswith("[") and ": " in text else text

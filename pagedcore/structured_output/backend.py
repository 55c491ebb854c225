"""The interface a grammar library implements: compile a spec once, then one matcher per sequence.

Bitmasks are int32 [rows, ceil(vocab / 32)], bit j of word w allowing token 32 * w + j (xgrammar's and
llguidance's common layout), so any backend's mask goes through the same apply (bitmask.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from pagedcore.structured_output.params import StructuredOutputsParams


class StructuredOutputGrammar(ABC):
    """One sequence's position in a compiled grammar."""

    num_accepted_tokens: int = 0  # tokens it accepted (the tests check it saw every output token)

    def accept_token(self, token_id: int) -> bool:
        """Advance by one sampled token; False (state unchanged) if the grammar forbids it."""
        ok = self._accept_token(token_id)
        self.num_accepted_tokens += ok
        return ok

    @abstractmethod
    def _accept_token(self, token_id: int) -> bool: ...

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into `bitmask[row]`."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """The grammar is complete and a stop token was accepted: the sequence ends ("stop")."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""

    @abstractmethod
    def fork(self) -> "StructuredOutputGrammar":
        """An independent copy in the same state (n > 1 samples, beams)."""


class MatcherGrammar(StructuredOutputGrammar):
    """A grammar over one library matcher that rolls back by a token count and forks into a copy
    (xgrammar's and llguidance's); a subclass says how to accept, mask, end and copy."""

    def __init__(self, matcher):
        self.matcher = matcher

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)
        self.num_accepted_tokens -= num_tokens

    def fork(self) -> "MatcherGrammar":
        copy = type(self)(self._fork_matcher())
        copy.num_accepted_tokens = self.num_accepted_tokens
        return copy

    @abstractmethod
    def _fork_matcher(self):
        """An independent copy of the matcher, in the same state."""


class StructuredOutputBackend(ABC):
    """Compiles specs for one tokenizer and vocabulary (the logits' width)."""

    name: str = "?"

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids

    @abstractmethod
    def compile(self, spec: StructuredOutputsParams) -> object:
        """The compiled grammar (thread-safe: runs in the manager's pool). Raises ValueError naming the
        problem for a spec this backend cannot compile."""

    @abstractmethod
    def matcher(self, compiled: object) -> StructuredOutputGrammar:
        """A fresh matcher at the grammar's start."""

    def fill_bitmask(self, grammars: list[StructuredOutputGrammar], bitmask: torch.Tensor, rows: list[int]) -> None:
        """Fill `bitmask[rows[i]]` from `grammars[i]`; backends may batch this."""
        for grammar, row in zip(grammars, rows):
            grammar.fill_bitmask(bitmask, row)


def choice_ebnf(choices: list[str]) -> str:
    """A grammar whose sentences are exactly the choices (JSON string escapes are valid EBNF ones)."""
    import json

    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)

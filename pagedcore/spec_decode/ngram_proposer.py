"""Prompt-lookup (n-gram) proposals: continue the sequence the way it continued the last time its
current suffix appeared in its own tokens (prompt and output). Costs no model, pays on
input-grounded text (editing, summarising, quoting, code) where the output copies the input."""

from __future__ import annotations

import numpy as np

from pagedcore.sequence import Sequence


class NgramProposer:
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int):
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[list[int]]:
        return [self.lookup(seq.token_ids, k) for seq, k in zip(seqs, num_tokens)]

    def lookup(self, token_ids: list[int], k: int) -> list[int]:
        """Up to k tokens after the latest earlier occurrence of the longest suffix (max_n down to min_n)."""
        tokens = np.asarray(token_ids, dtype=np.int32)
        size = tokens.itemsize
        haystack = tokens.tobytes()
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            needle = haystack[-n * size:]
            end = len(haystack) - size  # an occurrence must end before the last token: not the suffix itself
            while True:
                # bytes.rfind is C-speed; a hit must start on a token boundary
                pos = haystack.rfind(needle, 0, end)
                if pos < 0:
                    break
                if pos % size == 0:
                    start = pos // size + n
                    return tokens[start:start + k].tolist()
                end = pos + len(needle) - 1
        return []

    def release(self, seq_ids) -> None:
        pass  # keeps no state

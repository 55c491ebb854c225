"""The offline workload every engine runs: seeded random token-id prompts with exact output lengths."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass
class Workload:
    num_prompts: int = 64
    input_len: tuple[int, int] = (32, 256)
    output_len: tuple[int, int] = (16, 128)
    seed: int = 0

    def make(self, vocab_size: int) -> tuple[list[list[int]], list[int]]:
        """Prompts of random ids (clear of the low special-token range) and exact output lengths (EOS ignored)."""
        rng = random.Random(self.seed)
        prompts = [[rng.randrange(100, vocab_size) for _ in range(rng.randint(*self.input_len))]
                   for _ in range(self.num_prompts)]
        outputs = [rng.randint(*self.output_len) for _ in range(self.num_prompts)]
        return prompts, outputs

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


def add_workload_args(parser) -> None:
    """The workload flags every bench command shares (same defaults: same workload)."""
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-min", type=int, default=32)
    parser.add_argument("--input-max", type=int, default=256)
    parser.add_argument("--output-min", type=int, default=16)
    parser.add_argument("--output-max", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)


def workload_from_args(args) -> Workload:
    if not (1 <= args.input_min <= args.input_max and 1 <= args.output_min <= args.output_max):
        raise ValueError("need 1 <= --input-min <= --input-max and 1 <= --output-min <= --output-max")
    return Workload(args.num_prompts, (args.input_min, args.input_max), (args.output_min, args.output_max), args.seed)

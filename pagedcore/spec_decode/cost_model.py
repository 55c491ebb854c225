"""Pays or steps aside: speculation costs a wider target step (k + 1 tokens per sequence instead of
one, plus the draft's k steps for a model draft) and pays only in emitted tokens. On a CPU the
wider step is nearly free at batch 1 (the step reads every weight for one token anyway) and costs
about k + 1 times more once the batch makes the step compute-bound.

`measure_step_costs` times both steps at start-up for a few batch sizes on dummy sequences;
`SpecPolicy` then speculates at a batch size only while the tokens a verified sequence emits on
average (measured as it runs) exceed the step's cost ratio there. While off it still probes now and
then, so that the acceptance it decides on stays current.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from pagedcore.scheduler import SchedulerOutput
from pagedcore.sequence import Sequence
from pagedcore.sampling_params import SamplingParams

logger = logging.getLogger("pagedcore")

BATCH_SIZES = (1, 2, 4, 8, 16, 32)


@dataclass
class StepCosts:
    batch_sizes: list[int] = field(default_factory=list)
    decode_s: list[float] = field(default_factory=list)  # one token per sequence
    verify_s: list[float] = field(default_factory=list)  # k + 1 per sequence, the draft's k steps included

    def ratio(self, batch_size: int) -> float | None:
        """Verify over decode at the smallest measured batch >= batch_size; None past the table."""
        for b, d, v in zip(self.batch_sizes, self.decode_s, self.verify_s):
            if b >= batch_size:
                return v / d
        return None


def _time(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


@torch.inference_mode()
def measure_step_costs(engine, k: int, draft_runner=None, context_len: int = 64, repeats: int = 3,
                       batch_sizes=BATCH_SIZES) -> StepCosts:
    """Time a decode step and a verify step of the target (and k decode steps of the draft) on
    dummy sequences of `context_len` tokens, for each batch size that fits; every block goes back."""
    costs = StepCosts()
    gen = torch.Generator().manual_seed(0)
    limit = min(engine.config.max_num_seqs, engine.config.max_num_batched_tokens // (k + 1))
    for b in [b for b in batch_sizes if b <= limit]:
        seqs = [Sequence(-1 - i, "spec-measure", 0, torch.randint(0, engine.vocab_size, (context_len,),
                                                                   generator=gen).tolist(),
                         SamplingParams(), context_len + k + 1) for i in range(b)]
        runners = [(engine.runner, engine.kv)] + ([(draft_runner[0], draft_runner[1])] if draft_runner else [])
        if any(kv.num_free_blocks < b * -(-(context_len + k + 1) // kv.block_size) for _, kv in runners):
            break
        times = []
        for runner, kv in runners:
            for s in seqs:
                s.num_computed_tokens, s.block_table = 0, []
                kv.allocate_slots(s, context_len + k + 1)
            try:
                times.append(_measure_one(runner, seqs, context_len, k, repeats))
            finally:
                for s in seqs:
                    kv.free(s)
                    runner.input_batch.free(s.seq_id)
        decode, verify = times[0]
        if draft_runner:
            verify += k * times[1][0]
        costs.batch_sizes.append(b)
        costs.decode_s.append(decode)
        costs.verify_s.append(verify)
    logger.info("speculation cost (verify %d tokens / decode 1) by batch: %s", k + 1,
                {b: round(v / d, 2) for b, d, v in zip(costs.batch_sizes, costs.decode_s, costs.verify_s)})
    return costs


def _measure_one(runner, seqs: list[Sequence], context_len: int, k: int, repeats: int) -> tuple[float, float]:
    """(decode step, verify step) seconds: the context is prefilled first, so attention reads real KV."""
    for s in seqs:
        s.token_ids = s.prompt_token_ids[:context_len]
    runner.execute(SchedulerOutput(scheduled=[(s, context_len) for s in seqs]))
    for s in seqs:
        s.num_computed_tokens = context_len - 1  # the last context token is the one a decode step feeds

    def step(n):
        runner.execute(SchedulerOutput(scheduled=[(s, n) for s in seqs]))[1].argmax(dim=-1)

    decode = _time(lambda: step(1), repeats)
    for s in seqs:
        s.token_ids = s.prompt_token_ids[:context_len] + [s.prompt_token_ids[0]] * k
        s.num_draft_tokens = k
    try:
        verify = _time(lambda: step(k + 1), repeats)
    finally:
        for s in seqs:
            s.num_draft_tokens = 0
    return decode, verify


class SpecPolicy:
    """Whether to speculate at a batch size: fixed (`disable_by_batch_size`) or measured."""

    PROBE_EVERY = 16  # steps between probes while speculation does not pay
    MARGIN = 1.1  # the measured ratio leaves out proposing and rejection sampling: ask for 10% more
    EMA = 0.1  # weight of one step's acceptance in the running estimate

    def __init__(self, k: int, disable_by_batch_size: int | None, costs: StepCosts | None):
        self.k, self.fixed, self.costs = k, disable_by_batch_size, costs
        self.tokens_per_verify = 1 + k / 2  # optimistic until measured
        self._steps_off = 0

    def should_speculate(self, batch_size: int) -> bool:
        if self.fixed is not None:
            return batch_size < self.fixed
        ratio = self.costs.ratio(batch_size)
        if ratio is None:
            return False
        if self.tokens_per_verify > ratio * self.MARGIN:
            self._steps_off = 0
            return True
        self._steps_off += 1
        return self._steps_off % self.PROBE_EVERY == 0

    def observe(self, num_verified: int, num_emitted: int) -> None:
        """One step's verified sequences and the tokens they emitted."""
        if num_verified:
            self.tokens_per_verify += self.EMA * (num_emitted / num_verified - self.tokens_per_verify)

    def max_batch_size(self) -> int | None:
        """The largest batch size speculation currently runs at (0: none)."""
        if self.fixed is not None:
            return self.fixed - 1
        ok = [b for b, d, v in zip(self.costs.batch_sizes, self.costs.decode_s, self.costs.verify_s)
              if self.tokens_per_verify > v / d * self.MARGIN]
        return max(ok, default=0)

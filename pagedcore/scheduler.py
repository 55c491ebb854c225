"""Scheduler: iteration-level continuous batching under one token budget per step.

No prefill/decode phases (vLLM v1): each sequence has `num_computed_tokens` and `num_tokens`, and a
step gives each running sequence, then swapped ones, then waiting ones, as many of their missing
tokens as the budget allows (long prompts are chunked across steps). When blocks run out the
newest running sequence is preempted, by swap (its blocks move to the CPU pool) or by recompute
(its blocks are dropped and it re-prefills later, reusing what the prefix cache still holds).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from pagedcore.config import EngineConfig
from pagedcore.kv_cache_manager import KVCacheManager
from pagedcore.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    # (sequence, number of its tokens to compute this step), running ones first
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, cpu)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu, device)
    # sequences finished (stopped, aborted, dropped beams) since the last step with work:
    # the runner frees their rows of the persistent input batch
    finished_seq_ids: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class FCFSPolicy:
    """Waiting sequences in arrival order; preempted ones return to the front."""

    name = "fcfs"

    def add(self, waiting: deque[Sequence], seq: Sequence) -> None:
        waiting.append(seq)

    def readd_preempted(self, waiting: deque[Sequence], seq: Sequence) -> None:
        waiting.appendleft(seq)


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager, policy=None,
                 on_event: Callable[..., None] | None = None):
        self.config = config
        self.kv = kv
        self.policy = policy or FCFSPolicy()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: deque[Sequence] = deque()
        self.num_preemptions = 0
        self.num_swap_outs = 0
        self.num_recomputes = 0
        self._finished_seq_ids: list[int] = []
        self._on_event = on_event or (lambda kind, seq, mode=None: None)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.policy.add(self.waiting, seq)

    def add_running(self, seq: Sequence) -> None:
        """A forked sample joins its parent in the running queue."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        self._on_event("scheduled", seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if not out.preempted:  # admitting work right after preempting would only thrash
            budget = self._schedule_swapped(out, budget)
            if not self.swapped:  # swapped sequences come back before new ones start
                self._schedule_waiting(out, budget)
        out.blocks_to_copy = self.kv.take_pending_copies()
        if out.scheduled:  # the engine runs only steps with work: keep the news for one of those
            out.finished_seq_ids, self._finished_seq_ids = self._finished_seq_ids, []
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if num_new == 0:  # e.g. a beam waiting for its siblings
                i += 1
                continue
            while not self.kv.allocate_slots(seq, num_new):
                victim = self.running.pop()  # the newest
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                out.scheduled.append((seq, num_new))
                budget -= num_new
                i += 1
        return budget

    def _schedule_swapped(self, out: SchedulerOutput, budget: int) -> int:
        while self.swapped and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.swapped[0]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self.kv.can_swap_in(seq, num_new):
                break
            self.swapped.popleft()
            out.blocks_to_swap_in += self.kv.swap_in(seq)
            if not self.kv.allocate_slots(seq, num_new):  # can_swap_in counted these slots
                raise RuntimeError(f"swap-in of sequence {seq.seq_id}: no slots for {num_new} tokens after can_swap_in")
            self._start_running(seq, num_new, out)
            budget -= num_new
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            num_new = self.kv.allocate_new_sequence(seq, budget, self.config.enable_chunked_prefill)
            if num_new is None:
                break
            self.waiting.popleft()
            self._start_running(seq, num_new, out)
            budget -= num_new

    def _start_running(self, seq: Sequence, num_new: int, out: SchedulerOutput) -> None:
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        out.scheduled.append((seq, num_new))
        self._on_event("scheduled", seq)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        seq.num_preemptions += 1
        self.num_preemptions += 1
        if self._should_swap(seq):
            out.blocks_to_swap_out += self.kv.swap_out(seq)
            seq.status = SequenceStatus.SWAPPED
            self.swapped.append(seq)
            self.num_swap_outs += 1
            mode = "swap"
        else:
            self.kv.free(seq)
            seq.status = SequenceStatus.WAITING
            self.policy.readd_preempted(self.waiting, seq)
            self.num_recomputes += 1
            mode = "recompute"
        out.preempted.append(seq)
        self._on_event("preempted", seq, mode)

    def _should_swap(self, seq: Sequence) -> bool:
        """Swap long contexts (re-prefilling them costs more than two copies); recompute short ones."""
        mode = self.config.preemption_mode
        if mode == "recompute" or not self.kv.can_swap_out(seq):
            return False
        return mode == "swap" or seq.num_computed_tokens >= self.config.swap_min_tokens

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """Remove a sequence wherever it is and return its blocks."""
        if not status.finished:
            raise ValueError(f"finish() needs a finished status, got {status}")
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.swapped:
            self.swapped.remove(seq)
        self.kv.free(seq)
        seq.status = status
        self._finished_seq_ids.append(seq.seq_id)

"""Scheduler: iteration-level continuous batching under one token budget per step.

No prefill/decode phases (vLLM v1): each sequence has `num_computed_tokens` and `num_tokens`, and a
step gives each running sequence, then swapped ones, then waiting ones, as many of their missing
tokens as the budget allows (long prompts are chunked across steps). When blocks run out the
newest running sequence is preempted, by swap (its blocks move to the CPU pool) or by recompute
(its blocks are dropped and it re-prefills later, reusing what the prefix cache still holds).

After the step, `update_from_output` (vLLM v1's name) owns the rest of the life cycle: it advances
`num_computed_tokens`, rolls back rejected draft tokens, appends the sampled tokens, publishes full
blocks to the prefix cache, forks new samples (n > 1, beams) and finishes stopped sequences.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable

from pagedcore.config import EngineConfig
from pagedcore.kv_cache_manager import KVCacheManager
from pagedcore.scheduling_policies import FCFSPolicy
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


@dataclass
class SequenceSample:
    """One sequence's new tokens from one step (a row of vLLM v1's `sampled_token_ids`)."""

    seq: Sequence
    token_ids: list[int]  # usually one; empty when beam search appended its own
    logprobs: list[float]  # of each token
    top_logprobs: list[dict] | None = None  # per token, when the request asks for logprobs
    # Speculative decoding: the sequence's last `num_draft_tokens` tokens were drafts, verified this
    # step; `token_ids` are then the accepted drafts and the token after them (vLLM v1's convention).
    num_draft_tokens: int = 0
    fork_of: Sequence | None = None  # a new sample: it shares this sequence's blocks (n > 1, beams)
    # Multi-step decode: tokens of this sample that the step's later forwards took as inputs (all but the
    # last), so their K/V is computed too.
    num_fed_back: int = 0

    @property
    def num_rejected(self) -> int:
        """Drafts not accepted: every sampled token but the last is an accepted draft."""
        return self.num_draft_tokens - (len(self.token_ids) - 1) if self.num_draft_tokens else 0


@dataclass
class SampledOutput:
    """What sampling decided in one step; `Scheduler.update_from_output` applies it."""

    samples: list[SequenceSample] = field(default_factory=list)
    # ends decided by sampling itself (beam search drops beams and stops groups)
    finished: list[tuple[Sequence, SequenceStatus]] = field(default_factory=list)


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager, policy=None,
                 on_event: Callable[..., None] | None = None, eos_token_ids: Iterable[int] = ()):
        self.config = config
        self.kv = kv
        self.eos_token_ids = set(eos_token_ids)
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
        scheduled = {id(seq) for seq, _ in out.scheduled}
        for seq in self.running:  # drafts of sequences left out of this step are stale by the next
            if seq.num_draft_tokens and id(seq) not in scheduled:
                seq.drop_draft_tokens()
        out.blocks_to_copy = self.kv.take_pending_copies()
        if out.scheduled:  # the engine runs only steps with work: keep the news for one of those
            out.finished_seq_ids, self._finished_seq_ids = self._finished_seq_ids, []
        return out

    def reserve_lookahead(self, out: SchedulerOutput, num_steps: int) -> int:
        """Slots for `num_steps` tokens of every scheduled sequence (a multi-step decode feeds each step's token
        back num_steps - 1 times): num_steps if they all got them, else 1 (no preemption for a lookahead; slots
        already taken stay with their sequences for their next tokens)."""
        ok = all(self.kv.allocate_slots(seq, num_steps) for seq, _ in out.scheduled)
        out.blocks_to_copy += self.kv.take_pending_copies()
        return num_steps if ok else 1

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if num_new == 0:  # e.g. a beam waiting for its siblings
                i += 1
                continue
            # Drafts that do not fit the budget (or the free blocks) are dropped, not chunked:
            # verification needs the logits of all of a sequence's drafts in one step.
            seq.drop_draft_tokens(min(seq.num_draft_tokens, seq.num_tokens - seq.num_computed_tokens - num_new))
            if seq.num_draft_tokens and not self.kv.allocate_slots(seq, num_new):
                num_new -= seq.num_draft_tokens
                seq.drop_draft_tokens()
            while not self.kv.allocate_slots(seq, num_new):
                victim = self.running.pop(self._victim_index(i))
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
            if not self._lora_fits(seq):
                break
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
        i, lora_blocked = 0, False  # sequences whose grammar still compiles are stepped over, not waited for
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[i]
            if seq.waiting_for_grammar:
                i += 1
                continue
            if seq.lora is not None and (lora_blocked or not self._lora_fits(seq)):
                # Its adapter needs a slot that running adapters hold: it waits, and so do later
                # requests of adapters (running adapters drain, so it cannot starve); base-model
                # requests behind it go on.
                lora_blocked = True
                i += 1
                continue
            num_new = self.kv.allocate_new_sequence(seq, budget, self.config.enable_chunked_prefill)
            if num_new is None:
                break
            del self.waiting[i]
            self._start_running(seq, num_new, out)
            budget -= num_new

    def _lora_fits(self, seq: Sequence) -> bool:
        """Whether `seq` may join the running batch: its adapter is already running, or fewer than
        max_loras adapters are."""
        if seq.lora is None:
            return True
        running = {s.lora_uid for s in self.running if s.lora is not None}
        return seq.lora_uid in running or len(running) < self.config.max_loras

    def _start_running(self, seq: Sequence, num_new: int, out: SchedulerOutput) -> None:
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        out.scheduled.append((seq, num_new))
        self._on_event("scheduled", seq)

    def _victim_index(self, first: int) -> int:
        """Which running sequence to preempt; `running[:first]` are already scheduled this step."""
        pick = getattr(self.policy, "victim_index", None)  # optional for plugin policies
        return len(self.running) - 1 if pick is None else pick(self.running, first)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        seq.drop_draft_tokens()  # never computed; a re-prefill must not take them for real tokens
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

    # ---- after the step ---------------------------------------------------------------------
    def update_from_output(self, scheduler_output: SchedulerOutput, sampled: SampledOutput) -> None:
        """Apply a step: computed tokens, rollback of rejected drafts, sampled tokens and their stops,
        prefix-cache publishing, forks, and the ends that sampling decided."""
        for seq, n in scheduler_output.scheduled:
            seq.num_computed_tokens += n
        stopped = []
        for sample in sampled.samples:
            if sample.num_draft_tokens:
                self._rollback(sample)
            status = self._append(sample)
            if sample.num_fed_back:
                # A stop drops the tokens after it: what was computed past the kept tokens is not the sequence's.
                seq = sample.seq
                seq.num_computed_tokens = min(seq.num_computed_tokens + sample.num_fed_back, seq.num_tokens)
            if status is not None:
                stopped.append((sample.seq, status))
        # Publish before finishing (a finished prompt's blocks stay reusable) and after the
        # rollback (a block holding rejected drafts must never be published).
        for seq, _ in scheduler_output.scheduled:
            self.kv.cache_full_blocks(seq)
        for sample in sampled.samples:
            if sample.fork_of is not None:
                self.kv.fork(sample.fork_of, sample.seq)
                self.add_running(sample.seq)
        for seq, status in stopped:
            self._stop(seq, status)
        for seq, status in sampled.finished:
            self.finish(seq, status)

    def _rollback(self, sample: SequenceSample) -> None:
        """Take the drafts out (the accepted ones come back with the sample) and rewind the KV of
        the rejected ones."""
        seq = sample.seq
        self.kv.rewind(seq, sample.num_rejected)
        del seq.token_ids[seq.num_tokens - sample.num_draft_tokens:]
        seq.num_draft_tokens = 0

    def _append(self, sample: SequenceSample) -> SequenceStatus | None:
        """Append the tokens one by one; a stop drops the ones after it."""
        seq = sample.seq
        for i, token in enumerate(sample.token_ids):
            seq.append_token(token, sample.logprobs[i],
                             sample.top_logprobs[i] if sample.top_logprobs is not None else None)
            if seq.grammar is not None and not seq.grammar.accept_token(token):
                # The bitmask allows only what the grammar accepts: only a plugin's processor gets here.
                seq.stop_reason = f"token {token} violates the request's structured_outputs"
                return SequenceStatus.FINISHED_ABORTED
            status = self._check_stop(seq)
            if status is not None:
                return status
        return None

    def _check_stop(self, seq: Sequence) -> SequenceStatus | None:
        p = seq.params
        token = seq.token_ids[-1]
        can_stop = seq.num_output_tokens >= p.min_tokens
        stop_str = _detokenize(seq, token, can_stop)
        if stop_str is not None:
            seq.stop_reason = stop_str
            return SequenceStatus.FINISHED_STOPPED
        if seq.grammar is not None and seq.grammar.is_terminated():  # complete, its stop token accepted
            return SequenceStatus.FINISHED_STOPPED
        if can_stop and not p.ignore_eos and token in self.eos_token_ids:
            return SequenceStatus.FINISHED_STOPPED
        if can_stop and token in p.stop_token_ids:
            seq.stop_reason = token
            return SequenceStatus.FINISHED_STOPPED
        if (p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens) \
                or seq.num_tokens >= seq.max_total_tokens:
            return SequenceStatus.FINISHED_LENGTH
        return None

    def _stop(self, seq: Sequence, status: SequenceStatus) -> None:
        seq.finished_time = time.monotonic()
        self.finish(seq, status)
        self._on_event("finished", seq)

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


def _detokenize(seq: Sequence, token: int, can_stop: bool) -> str | None:
    """Feed the sequence's detokenizer; returns the stop string the token completed, if any."""
    det = seq.detokenizer
    if det is None:
        return None
    if can_stop:
        return det.update([token])
    # As in vLLM, stop strings count only once min_tokens are out: a match now must not cut the
    # text (the detokenizer would also ignore every later token). The stop list stays set for
    # streaming, which withholds a tail that may still become one.
    stop, det.stop = det.stop, []
    try:
        det.update([token])
    finally:
        det.stop = stop
    return None

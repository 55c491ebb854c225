"""Waiting-queue policies: who is admitted next, and who is preempted first when blocks run out.

A policy (built in, or from a plugin's `pagedcore_scheduling_policy` hook) has `add` and
`readd_preempted`, and may have `victim_index` (default: the newest running sequence) and
`uses_priority` (whether requests may set a priority).
"""

from __future__ import annotations

import bisect
from collections import deque

from pagedcore.sequence import Sequence


class FCFSPolicy:
    """Waiting sequences in arrival order; preempted ones return to the front; the newest running
    sequence is preempted first."""

    name = "fcfs"
    uses_priority = False

    def add(self, waiting: deque[Sequence], seq: Sequence) -> None:
        waiting.append(seq)

    def readd_preempted(self, waiting: deque[Sequence], seq: Sequence) -> None:
        waiting.appendleft(seq)

    def victim_index(self, running: list[Sequence], first: int) -> int:
        return len(running) - 1


def _priority_key(seq: Sequence) -> tuple:
    # vLLM's convention: a lower value runs earlier; ties go by arrival.
    return seq.priority, seq.arrival_time, seq.seq_id


class PriorityPolicy:
    """Waiting sequences by (priority, arrival), lower first, preempted ones included; the running
    sequence with the highest (priority, arrival) among those not yet scheduled is preempted first."""

    name = "priority"
    uses_priority = True

    def add(self, waiting: deque[Sequence], seq: Sequence) -> None:
        keys = [_priority_key(s) for s in waiting]  # O(waiting): admission is per request, not per token
        waiting.insert(bisect.bisect_right(keys, _priority_key(seq)), seq)

    readd_preempted = add

    def victim_index(self, running: list[Sequence], first: int) -> int:
        """`running[first:]` are not yet scheduled this step; only they can give up their blocks."""
        return max(range(first, len(running)), key=lambda i: _priority_key(running[i]))


POLICIES = {"fcfs": FCFSPolicy, "priority": PriorityPolicy}

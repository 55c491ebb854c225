"""Beam search in the engine core: live beams are Sequences whose forks and frees share KV blocks.

One step of a request's beam search runs once every live beam has its next-token logits (beams
may be computed in different engine steps under a tight budget or after a preemption). The
selection follows transformers' `_beam_search` exactly (top-K continuations with
K = max(2, 1 + #eos) * width, finished hypotheses scored `sum_logprobs / len ** length_penalty`,
its early-stopping heuristic), so results match `generate(num_beams=...)`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from pagedcore.sampling_params import SamplingParams
from pagedcore.scheduler import SampledOutput, SequenceSample
from pagedcore.sequence import Sequence, SequenceStatus

_NEG = -1.0e9


@dataclass
class Hypothesis:
    score: float  # length-penalised, as transformers' sequences_scores
    token_ids: list[int]  # generated tokens, the final eos included
    cumulative_logprob: float


@dataclass
class BeamGroup:
    width: int
    num_return: int
    eos_token_ids: list[int]
    max_tokens: int  # generated tokens at most
    length_penalty: float
    early_stopping: bool | str
    beams: list[Sequence] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)  # running sums of logprobs, per beam
    finished: list[Hypothesis] = field(default_factory=list)
    pending: dict[int, torch.Tensor] = field(default_factory=dict)  # seq_id -> next-token logits
    improvable: bool = True  # transformers' is_early_stop_heuristic_unsatisfied
    done: bool = False

    def __post_init__(self) -> None:
        self.finished = [Hypothesis(_NEG, [], 0.0) for _ in range(self.width)]

    @classmethod
    def for_request(cls, params: SamplingParams, first: Sequence, eos_token_ids) -> BeamGroup:
        max_tokens = first.max_total_tokens - first.num_prompt_tokens
        if params.max_tokens is not None:
            max_tokens = min(max_tokens, params.max_tokens)
        eos = [] if params.ignore_eos else sorted(eos_token_ids) + list(params.stop_token_ids)
        width = params.best_of or params.n
        return cls(width, params.n, eos, max_tokens, params.length_penalty, params.early_stopping,
                   beams=[first], scores=[0.0])

    @property
    def num_candidates(self) -> int:
        return max(2, 1 + len(self.eos_token_ids)) * self.width

    def add_logits(self, seq: Sequence, logits: torch.Tensor) -> bool:
        """Record a beam's next-token logits; True when every live beam has them."""
        self.pending[seq.seq_id] = logits
        return all(b.seq_id in self.pending for b in self.beams)

    def step(self, fork: Callable[[Sequence], Sequence], drop: Callable[[Sequence], None]) -> None:
        """Advance every live beam by one token. `fork(parent)` returns a new sequence sharing the
        parent's blocks; `drop(seq)` frees a beam that was not continued."""
        logits = torch.stack([self.pending.pop(b.seq_id) for b in self.beams]).float()
        vocab = logits.shape[-1]
        acc = torch.log_softmax(logits, -1) + torch.tensor(self.scores)[:, None]
        k = min(self.num_candidates, acc.numel())
        top_lp, top_idx = acc.view(-1).topk(k)
        parents, tokens = (top_idx // vocab).tolist(), (top_idx % vocab).tolist()
        new_len = self.beams[0].num_output_tokens + 1
        hits = torch.tensor([t in self.eos_token_ids or new_len >= self.max_tokens for t in tokens])
        self._update_finished(top_lp, hits, parents, tokens, new_len)
        run_lp = top_lp + hits.float() * _NEG
        sel = run_lp.topk(min(self.width, k)).indices.tolist()
        self._advance(sel, parents, tokens, run_lp.tolist(), fork, drop)
        self._update_heuristic(new_len)
        all_hit = bool(hits.all())
        open_beam = not (self._all_finished() and self.early_stopping is True)
        self.done = not (self.improvable and open_beam and not all_hit)

    def step_into(self, out: SampledOutput, seq_ids: Iterator[int]) -> None:
        """`step`, for the engine: it appends its tokens itself; the beams it forks (new ids from
        `seq_ids`) and drops are left to the scheduler, through `out`."""
        parents = {}

        def fork(parent: Sequence) -> Sequence:
            child = Sequence(next(seq_ids), parent.request_id, parent.index, parent.prompt_token_ids,
                             parent.params, parent.max_total_tokens, arrival_time=parent.arrival_time,
                             priority=parent.priority, cache_salt=parent.cache_salt, lora=parent.lora,
                             token_ids=list(parent.token_ids))
            parents[child.seq_id] = parent
            return child

        self.step(fork=fork, drop=lambda seq: out.finished.append((seq, SequenceStatus.FINISHED_ABORTED)))
        out.samples += [SequenceSample(seq, [], [], fork_of=parents.get(seq.seq_id)) for seq in self.beams]
        if self.done:
            out.finished += [(seq, SequenceStatus.FINISHED_STOPPED) for seq in self.beams]

    def results(self) -> list[Hypothesis]:
        return sorted(self.finished, key=lambda h: h.score, reverse=True)[:self.num_return]

    def _update_finished(self, top_lp, hits, parents, tokens, new_len) -> None:
        just_finished = hits & (torch.arange(len(tokens)) < self.width)
        scores = top_lp / (new_len ** self.length_penalty)
        if self._all_finished() and self.early_stopping is True:
            scores = scores + _NEG
        if not self.improvable:
            scores = scores + _NEG
        scores = scores + (~just_finished).float() * _NEG
        merged = torch.cat([torch.tensor([h.score for h in self.finished]), scores])
        keep = merged.topk(self.width).indices.tolist()
        old, lp = self.finished, top_lp.tolist()
        self.finished = [
            old[i] if i < self.width else Hypothesis(
                merged[i].item(), self.beams[parents[i - self.width]].output_token_ids + [tokens[i - self.width]],
                lp[i - self.width])
            for i in keep]

    def _advance(self, sel, parents, tokens, run_lp, fork, drop) -> None:
        old = self.beams
        used = set()
        chosen: list[tuple[Sequence, int]] = []
        for i in sel:
            parent = old[parents[i]]
            # The first continuation of a beam takes it over; any further one forks its blocks.
            seq = parent if parents[i] not in used else fork(parent)
            used.add(parents[i])
            chosen.append((seq, tokens[i]))
        for j, seq in enumerate(old):
            if j not in used:
                drop(seq)
        for seq, token in chosen:
            seq.append_token(token, 0.0)
        self.beams = [seq for seq, _ in chosen]
        self.scores = [run_lp[i] for i in sel]

    def _update_heuristic(self, new_len: int) -> None:
        if not self.improvable or not self._all_finished():
            return
        if self.early_stopping == "never" and self.length_penalty > 0:
            best_len = self.max_tokens
        else:
            best_len = new_len
        best_running = self.scores[0] / (best_len ** self.length_penalty)
        self.improvable = best_running > min(h.score for h in self.finished)

    def _all_finished(self) -> bool:
        return all(h.score > _NEG / 2 for h in self.finished)

"""Turns sequences into RequestOutputs: cumulative, streamed deltas, or final only; best_of selection."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pagedcore.beam_search import BeamGroup
from pagedcore.metrics import MetricsRecorder
from pagedcore.outputs import CompletionOutput, Logprob, OutputKind, RequestMetrics, RequestOutput
from pagedcore.sampling_params import SamplingParams
from pagedcore.sequence import Sequence


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    output_kind: OutputKind
    seqs: list[Sequence] = field(default_factory=list)
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(arrival_time=time.monotonic()))
    num_sent_tokens: dict[int, int] = field(default_factory=dict)  # per seq index, for deltas
    pending_forks: list[Sequence] = field(default_factory=list)  # samples not yet forked from seqs[0]
    beam: BeamGroup | None = None  # set for beam search: its hypotheses are the outputs
    deadline: float | None = None  # time.monotonic() past which the request is aborted (timeout)

    @property
    def finished(self) -> bool:
        if self.beam is not None:
            return self.beam.done
        return all(s.is_finished for s in self.seqs)


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.recorder = MetricsRecorder()  # request timings, read by pagedcore.metrics.EngineMetrics

    def make_logprobs(self, token_id: int, logprob: float, top_ids: list[int], top_lps: list[float]) -> dict[int, Logprob]:
        d = {tid: Logprob(lp, rank + 1) for rank, (tid, lp) in enumerate(zip(top_ids, top_lps))}
        if token_id not in d:
            d[token_id] = Logprob(logprob, None)
        return d

    def make_output(self, state: RequestState, finished: bool | None = None) -> RequestOutput | None:
        """The request's output now (None: a final-only request not yet finished); `finished`: state.finished,
        where the caller has it already."""
        finished = state.finished if finished is None else finished
        self._update_timings(state, finished)
        if state.output_kind is OutputKind.FINAL_ONLY and not finished:
            return None
        if state.beam is not None:
            completions = [self._beam_completion(state, h, i) for i, h in enumerate(state.beam.results())]
        else:
            seqs = self._select(state) if finished else state.seqs
            delta = state.output_kind is OutputKind.DELTA
            completions = [self._completion(state, seq, i, delta) for i, seq in enumerate(seqs)]
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, completions, finished,
                             state.metrics, num_cached_tokens=state.seqs[0].num_cached_tokens)

    def _update_timings(self, state: RequestState, finished: bool) -> None:
        """First token and finish times, each recorded once (final-only requests included)."""
        m = state.metrics
        if m.first_token_time is None:
            m.first_token_time = min((s.first_token_time for s in state.seqs if s.first_token_time), default=None)
            if m.first_token_time is not None:
                self.recorder.first_token(len(state.prompt_token_ids), m)
        if finished and m.finished_time is None:
            m.finished_time = time.monotonic()
            self.recorder.finished(max((s.num_output_tokens for s in state.seqs), default=0), m)

    def _select(self, state: RequestState) -> list[Sequence]:
        """The n best of best_of by cumulative logprob (all of them when best_of is unset)."""
        n = state.params.n
        if len(state.seqs) == n:
            return state.seqs
        return sorted(state.seqs, key=lambda s: s.cumulative_logprob, reverse=True)[:n]

    def _beam_completion(self, state: RequestState, h, index: int) -> CompletionOutput:
        eos = state.beam.eos_token_ids
        reason = "stop" if h.token_ids and h.token_ids[-1] in eos else "length"
        text = self.tokenizer.decode(h.token_ids, skip_special_tokens=state.params.skip_special_tokens)
        return CompletionOutput(index, text, list(h.token_ids), h.cumulative_logprob, None, reason, score=h.score)

    def _completion(self, state: RequestState, seq: Sequence, index: int, delta: bool) -> CompletionOutput:
        out_ids = seq.output_token_ids
        logprobs = seq.logprobs
        if delta:
            sent = state.num_sent_tokens.get(seq.index, 0)
            state.num_sent_tokens[seq.index] = len(out_ids)
            text = seq.detokenizer.get_next_output_text(seq.is_finished, delta=True)
            out_ids = out_ids[sent:]
            logprobs = logprobs[sent:] if logprobs is not None else None
        else:
            text = seq.detokenizer.get_next_output_text(seq.is_finished, delta=False)
        reason = seq.status.value if seq.is_finished else None
        cumulative = None if seq.params.argmax_only else seq.cumulative_logprob
        return CompletionOutput(index, text, out_ids, cumulative, logprobs, reason, seq.stop_reason)

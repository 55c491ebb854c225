"""Engine metrics: one snapshot of the queues, the KV cache, token counts and request timings, under
the one naming scheme every front door publishes.

The engine imports no metrics library. `EngineMetrics.from_engine(engine)` reads the scheduler, the
KV cache manager and the output processor's `MetricsRecorder` (which times each request), and the
doors render it: BentoML through prometheus_client on its `/metrics`, Triton through the Python
backend's custom metrics on the server's metrics port. `METRICS` is the one table of names, kinds
and help texts; the names are vLLM's, which the Kubernetes Gateway API Inference Extension reads
(`pagedcore:num_requests_waiting` where vLLM says `vllm:num_requests_waiting`).

Both doors' metric APIs are push-only (prometheus_client in BentoML's multiprocess mode, Triton's
`MetricFamily`), so `EngineMetrics.updates_since(earlier)` turns two snapshots into what to push: a
gauge's value, a counter's increase, a histogram's new observations; `MetricsPublisher` pushes them
from a thread. A histogram keeps the count and the sum of the observations in each bucket: observing
each bucket's mean as many times as that bucket grew gives a push-only histogram the same bucket
counts and the same sum as ours.

`EngineStats` is the smaller per-step record the engine hands the `pagedcore_step_end` hook.
"""

from __future__ import annotations

import math
import threading
from bisect import bisect_left
from dataclasses import dataclass
from typing import Callable, Iterator

from pagedcore.limits import ABORT_REASONS, REJECT_REASONS
from pagedcore.outputs import RequestMetrics

PREFIX = "pagedcore:"

# Upper bounds in seconds (+Inf is implied); vLLM's, with finer low ends for fast decode steps.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0)


# ---- histograms ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class HistogramSnapshot:
    buckets: tuple[float, ...]  # upper bounds; one more bucket, +Inf, is implied
    counts: tuple[int, ...]  # observations per bucket (not cumulative), len(buckets) + 1
    sums: tuple[float, ...]  # their sum, per bucket

    @property
    def count(self) -> int:
        return sum(self.counts)

    @property
    def sum(self) -> float:
        return math.fsum(self.sums)

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, observations at or below it), +Inf last: Prometheus' `le` buckets."""
        out, total = [], 0
        for le, n in zip((*self.buckets, math.inf), self.counts):
            total += n
            out.append((le, total))
        return out

    def observations_since(self, earlier: HistogramSnapshot | None) -> list[tuple[float, int]]:
        """(value, times) to observe into a push-only histogram that holds `earlier` so that it holds
        this one: each bucket's new observations as their mean, which lies in the same bucket."""
        lows, highs = (-math.inf, *self.buckets), (*self.buckets, math.inf)
        out = []
        for i, (n, s) in enumerate(zip(self.counts, self.sums)):
            if earlier is not None:
                n, s = n - earlier.counts[i], s - earlier.sums[i]
            if n > 0:  # clamped: rounding must not move the mean across a bucket bound
                out.append((min(max(s / n, math.nextafter(lows[i], math.inf)), highs[i]), n))
        return out


class Histogram:
    """Per-bucket counts and sums. Not locked: its owner (`MetricsRecorder`) locks."""

    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = tuple(buckets)
        self._counts = [0] * (len(self.buckets) + 1)
        self._sums = [0.0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        i = bisect_left(self.buckets, value)  # the first bound >= value: Prometheus' `le`
        self._counts[i] += 1
        self._sums[i] += value

    def snapshot(self) -> HistogramSnapshot:
        return HistogramSnapshot(self.buckets, tuple(self._counts), tuple(self._sums))


# ---- what the output processor records per request -------------------------------------------------
class MetricsRecorder:
    """Request timings, recorded by the output processor in the engine thread and read from any:
    prompt tokens and time to first token when a request's first token is out; time per output token
    and end-to-end latency when it finishes (aborted requests are not timed)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._prompt_tokens = 0
        self._ttft = Histogram(TTFT_BUCKETS)
        self._tpot = Histogram(TPOT_BUCKETS)
        self._e2e = Histogram(E2E_BUCKETS)

    def first_token(self, num_prompt_tokens: int, m: RequestMetrics) -> None:
        with self._lock:
            self._prompt_tokens += num_prompt_tokens
            self._ttft.observe(m.first_token_time - m.arrival_time)

    def finished(self, num_output_tokens: int, m: RequestMetrics) -> None:
        """`num_output_tokens`: of the request's longest sample."""
        with self._lock:
            self._e2e.observe(m.finished_time - m.arrival_time)
            if num_output_tokens > 1 and m.first_token_time is not None:
                self._tpot.observe((m.finished_time - m.first_token_time) / (num_output_tokens - 1))

    def snapshot(self) -> tuple[int, HistogramSnapshot, HistogramSnapshot, HistogramSnapshot]:
        with self._lock:
            return self._prompt_tokens, self._ttft.snapshot(), self._tpot.snapshot(), self._e2e.snapshot()


# ---- the one table of names ----------------------------------------------------------------------------
@dataclass(frozen=True)
class MetricSpec:
    field: str  # the EngineMetrics field
    kind: str  # "gauge" | "counter" | "histogram"
    help: str
    buckets: tuple[float, ...] = ()  # histograms: upper bounds, +Inf implied
    label: str | None = None  # a labelled counter: one series per value, all shown from the start
    label_values: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        """The exposed name: counters end in `_total` (prometheus_client adds it; Triton takes it as is)."""
        return PREFIX + self.field + ("_total" if self.kind == "counter" else "")


METRICS = (
    MetricSpec("num_requests_running", "gauge",
               "Sequences in the running batch (a request with n samples counts n once they run)"),
    MetricSpec("num_requests_waiting", "gauge",
               "Sequences waiting to be scheduled, preempted ones included: the queue a gateway balances on"),
    MetricSpec("num_requests_swapped", "gauge", "Preempted sequences whose KV blocks are swapped out to CPU"),
    MetricSpec("kv_cache_usage_perc", "gauge",
               "Fraction of KV cache blocks in use, 0 to 1 (cached blocks no sequence holds count as free)"),
    MetricSpec("kv_cache_used_blocks", "gauge", "KV cache blocks in use"),
    MetricSpec("kv_cache_total_blocks", "gauge", "KV cache blocks in the pool"),
    MetricSpec("num_preemptions", "counter", "Sequences preempted (swapped out or dropped for recompute)"),
    MetricSpec("prompt_tokens", "counter", "Prompt tokens of requests that produced their first token"),
    MetricSpec("generation_tokens", "counter", "Tokens sampled, every sample and beam included"),
    MetricSpec("prefix_cache_queries", "counter", "Prompt tokens looked up in the prefix cache at admission"),
    MetricSpec("prefix_cache_hits", "counter", "Prompt tokens served from the prefix cache at admission"),
    MetricSpec("spec_decode_num_drafts", "counter", "Speculative decoding: sequence-steps verified with drafts"),
    MetricSpec("spec_decode_num_draft_tokens", "counter", "Speculative decoding: draft tokens proposed and verified"),
    MetricSpec("spec_decode_num_accepted_tokens", "counter", "Speculative decoding: draft tokens accepted"),
    MetricSpec("spec_decode_acceptance_rate", "gauge",
               "Speculative decoding: accepted / proposed draft tokens since start, 0 to 1"),
    MetricSpec("spec_decode_mean_acceptance_length", "gauge",
               "Speculative decoding: tokens a verified sequence emits per step since start (1 + accepted drafts)"),
    MetricSpec("requests_rejected", "counter",
               "Requests refused before they ran, by reason: the limit they hit (an EngineConfig setting), "
               "'invalid' input, or 'unavailable' (shutting down, unhealthy)", label="reason",
               label_values=REJECT_REASONS),
    MetricSpec("requests_aborted", "counter",
               "Requests ended before they finished, by reason: 'client' (disconnect, cancel), 'timeout' "
               "(deadline), 'error' (a failed step), 'shutdown'", label="reason", label_values=ABORT_REASONS),
    MetricSpec("step_failures", "counter", "Engine steps that raised (their requests failed; the engine went on)"),
    MetricSpec("engine_healthy", "gauge", "1 while the engine serves, 0 once repeated step failures marked it unhealthy"),
    MetricSpec("time_to_first_token_seconds", "histogram",
               "Time from a request's arrival at the engine to its first token", TTFT_BUCKETS),
    MetricSpec("time_per_output_token_seconds", "histogram",
               "Per finished request: (finish - first token) / (output tokens - 1), of its longest sample",
               TPOT_BUCKETS),
    MetricSpec("e2e_request_latency_seconds", "histogram",
               "Time from a request's arrival at the engine to its finish", E2E_BUCKETS),
)


@dataclass(frozen=True)
class Update:
    """One push to a door's metric: a gauge's value, a counter's increase, or `times` observations
    of `value` into a histogram."""

    spec: MetricSpec
    value: float
    times: int = 1
    label_value: str | None = None  # for a labelled counter: which series

    def apply(self, metric, increment: str = "inc") -> None:
        """Push to a door's metric object: `set` / `observe` as both doors' libraries name them, and
        the counter's increment method (`inc` in prometheus_client, `increment` in Triton's)."""
        if self.spec.kind == "gauge":
            metric.set(self.value)
        elif self.spec.kind == "counter":
            getattr(metric, increment)(self.value)
        else:
            for _ in range(self.times):
                metric.observe(self.value)


# ---- one step's stats ------------------------------------------------------------------------------------
@dataclass
class EngineStats:
    """One engine step, for the `pagedcore_step_end` hook (`LLMEngine.stats()` outside a step)."""

    num_running: int
    num_waiting: int
    num_swapped: int
    num_free_blocks: int
    num_total_blocks: int
    num_preemptions: int
    num_scheduled_tokens: int  # this step
    num_generated_tokens: int  # this step
    total_generated_tokens: int
    step_time: float  # seconds, this step
    # speculative decoding (zero when off): see SpecDecodeStats
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_max_batch_size: int | None = None  # speculation runs below this batch size now (None: off)

    @property
    def spec_acceptance_rate(self) -> float:
        return self.spec_num_accepted_tokens / self.spec_num_draft_tokens if self.spec_num_draft_tokens else 0.0

    @property
    def spec_mean_acceptance_length(self) -> float:
        """Tokens a verified sequence emits per step: 1 + its accepted drafts."""
        return 1 + self.spec_num_accepted_tokens / self.spec_num_drafts if self.spec_num_drafts else 0.0

    @property
    def kv_usage(self) -> float:
        return 1 - self.num_free_blocks / self.num_total_blocks

    @classmethod
    def from_engine(cls, engine, scheduled_tokens: int = 0, generated: int = 0, step_time: float = 0.0) -> EngineStats:
        s = engine.scheduler
        stats = cls(len(s.running), len(s.waiting), len(s.swapped), engine.kv.num_free_blocks,
                    engine.kv.num_blocks, s.num_preemptions, scheduled_tokens, generated,
                    engine.total_generated_tokens, step_time)
        if engine.spec is not None:
            st = engine.spec.stats
            stats.spec_num_drafts, stats.spec_num_draft_tokens = st.num_drafts, st.num_draft_tokens
            stats.spec_num_accepted_tokens = st.num_accepted_tokens
            stats.spec_max_batch_size = engine.spec.max_batch_size
        return stats


# ---- the snapshot ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class EngineMetrics:
    num_requests_running: int
    num_requests_waiting: int
    num_requests_swapped: int
    kv_cache_usage_perc: float
    kv_cache_used_blocks: int
    kv_cache_total_blocks: int
    num_preemptions: int
    prompt_tokens: int
    generation_tokens: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    spec_decode_num_drafts: int
    spec_decode_num_draft_tokens: int
    spec_decode_num_accepted_tokens: int
    spec_decode_acceptance_rate: float
    spec_decode_mean_acceptance_length: float
    requests_rejected: tuple[int, ...]  # per REJECT_REASONS
    requests_aborted: tuple[int, ...]  # per ABORT_REASONS
    step_failures: int
    engine_healthy: int
    time_to_first_token_seconds: HistogramSnapshot
    time_per_output_token_seconds: HistogramSnapshot
    e2e_request_latency_seconds: HistogramSnapshot

    @classmethod
    def from_engine(cls, engine) -> EngineMetrics:
        """Read an `LLMEngine` from any thread: lengths and counters only, no iteration over its
        queues, so a step in flight cannot break the read (a snapshot may straddle one, though)."""
        s, kv = engine.scheduler, engine.kv
        prompt_tokens, ttft, tpot, e2e = engine.output_processor.recorder.snapshot()
        total = kv.num_blocks
        used = total - kv.num_free_blocks
        spec = engine.spec.stats if getattr(engine, "spec", None) is not None else None
        spec_counts = (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens, spec.acceptance_rate,
                       spec.mean_acceptance_length) if spec is not None else (0, 0, 0, 0.0, 0.0)
        return cls(len(s.running), len(s.waiting), len(s.swapped), used / total, used, total, s.num_preemptions,
                   prompt_tokens, engine.total_generated_tokens, kv.num_prefix_query_tokens, kv.num_prefix_hit_tokens,
                   *spec_counts, engine.rejected.snapshot(), engine.aborted.snapshot(), engine.num_step_failures,
                   int(engine.healthy), ttft, tpot, e2e)

    def value(self, spec: MetricSpec):
        return getattr(self, spec.field)

    def updates_since(self, earlier: EngineMetrics | None) -> Iterator[Update]:
        """What to push to metrics that hold `earlier` (None: fresh ones) so that they hold this."""
        for spec in METRICS:
            now, then = self.value(spec), earlier.value(spec) if earlier is not None else None
            if spec.kind == "gauge":
                yield Update(spec, now)
            elif spec.label is not None:
                for i, label_value in enumerate(spec.label_values):
                    before = then[i] if then is not None else 0
                    if now[i] > before or then is None:  # fresh: every series shows, at 0 if need be
                        yield Update(spec, now[i] - before, label_value=label_value)
            elif spec.kind == "counter":
                if now > (then or 0):
                    yield Update(spec, now - (then or 0))
            else:
                for value, times in now.observations_since(then):
                    yield Update(spec, value, times)


class MetricsPublisher:
    """Pushes the engine's metrics into a door's metric objects: once now, then every `interval` s
    from a daemon thread. `push(update)` is the door's one function that knows its metrics library."""

    def __init__(self, engine, push: Callable[[Update], None], interval: float,
                 on_error: Callable[[Exception], None] = lambda e: None):
        self.engine, self.push, self.interval, self.on_error = engine, push, interval, on_error
        self._last: EngineMetrics | None = None
        self._stop = threading.Event()
        self.publish()
        self._thread = threading.Thread(target=self._run, name="pagedcore-metrics", daemon=True)
        self._thread.start()

    def publish(self) -> None:
        now = EngineMetrics.from_engine(self.engine)
        for update in now.updates_since(self._last):
            self.push(update)
        self._last = now

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.publish()
            except Exception as e:  # a metrics hiccup must never take the server down
                self.on_error(e)

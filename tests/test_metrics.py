"""EngineMetrics over a real (tiny, random-weight) engine: gauges, counters and histogram
observations agree with what ran; the push-only replay the doors use reproduces every snapshot."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from pagedcore import LLM, InvalidRequestError, SamplingParams, hookimpl
from pagedcore.limits import ABORT_REASONS, REJECT_REASONS
from pagedcore.llm_engine import LLMEngine
from pagedcore.metrics import METRICS, EngineMetrics, Histogram

ENGINE = dict(block_size=8, num_threads=1)


def prompts(*lengths: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 49152, (n,), generator=g).tolist() for n in lengths]


def exact(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return str(tiny_model_dir("llama"))


class Preemptions:
    def __init__(self):
        self.count = 0

    @hookimpl
    def pagedcore_request_event(self, event, request_id, seq_index, info):
        self.count += event == "preempted"


# ---- the histogram on its own ------------------------------------------------------------------------
def test_histogram_buckets_are_prometheus_le_and_the_replay_reproduces_them():
    h = Histogram((0.1, 1.0))
    values = [0.05, 0.1, 0.1000001, 0.7, 1.0, 3.0, 9.0]
    for v in values[:3]:
        h.observe(v)
    first = h.snapshot()
    for v in values[3:]:
        h.observe(v)
    snap = h.snapshot()
    assert snap.counts == (2, 3, 2)  # a value equal to a bound falls in that bound's bucket
    assert snap.cumulative() == [(0.1, 2), (1.0, 5), (math.inf, 7)]
    assert snap.count == 7 and snap.sum == pytest.approx(sum(values))

    replay = Histogram((0.1, 1.0))  # a push-only histogram that saw `first`, then only the news
    for since in (None, first):
        for value, times in (snap if since else first).observations_since(since):
            for _ in range(times):
                replay.observe(value)
    assert replay.snapshot().counts == snap.counts
    assert replay.snapshot().sum == pytest.approx(snap.sum)


# ---- over a real engine ----------------------------------------------------------------------------------
def test_counts_and_observations_match_what_ran(model_dir):
    llm = LLM(model_dir, num_kv_blocks=64, enable_prefix_caching=False, **ENGINE)
    before = EngineMetrics.from_engine(llm.engine)
    assert before.time_to_first_token_seconds.count == before.prompt_tokens == before.generation_tokens == 0
    ps = prompts(5, 12, 20, 9)
    params = [exact(1), exact(4), exact(7), exact(6, n=2)]
    outs = llm.generate(ps, params, use_tqdm=False)
    m = EngineMetrics.from_engine(llm.engine)

    assert m.prompt_tokens == sum(map(len, ps))  # once per request, n=2 included
    assert m.generation_tokens == sum(len(c.token_ids) for o in outs for c in o.outputs) == 1 + 4 + 7 + 2 * 6
    ttft, tpot, e2e = m.time_to_first_token_seconds, m.time_per_output_token_seconds, m.e2e_request_latency_seconds
    assert ttft.count == e2e.count == 4
    assert tpot.count == 3  # a one-token request has no time per output token
    # The same timings the requests carry, observed once each.
    ms = [o.metrics for o in outs]
    assert ttft.sum == pytest.approx(sum(x.first_token_time - x.arrival_time for x in ms), abs=1e-9)
    assert e2e.sum == pytest.approx(sum(x.finished_time - x.arrival_time for x in ms), abs=1e-9)
    assert tpot.sum == pytest.approx(sum((x.finished_time - x.first_token_time) / (n - 1)
                                         for x, n in zip(ms[1:], (4, 7, 6))), abs=1e-9)
    assert all(0 < x.first_token_time - x.arrival_time <= x.finished_time - x.arrival_time for x in ms)
    # Idle again: nothing queued, every block back.
    assert (m.num_requests_running, m.num_requests_waiting, m.num_requests_swapped) == (0, 0, 0)
    assert m.kv_cache_used_blocks == 0 and m.kv_cache_usage_perc == 0.0 and m.kv_cache_total_blocks == 64
    assert m.num_preemptions == 0


def test_gauges_show_the_batch_and_the_queue_mid_run(model_dir):
    engine = LLMEngine(model=model_dir, num_kv_blocks=64, max_num_seqs=2, **ENGINE)
    for i, p in enumerate(prompts(10, 17, 4, seed=1)):
        engine.add_request(str(i), p, exact(8))
    m = EngineMetrics.from_engine(engine)
    assert (m.num_requests_running, m.num_requests_waiting, m.kv_cache_used_blocks) == (0, 3, 0)

    engine.step()
    m = EngineMetrics.from_engine(engine)
    running = engine.scheduler.running
    assert (m.num_requests_running, m.num_requests_waiting) == (2, 1)
    assert m.kv_cache_used_blocks == len({b for s in running for b in s.block_table}) == 2 + 3
    assert m.kv_cache_usage_perc == pytest.approx(5 / 64)
    assert m.time_to_first_token_seconds.count == 2 and m.prompt_tokens == 10 + 17

    engine.abort_request(["0", "1", "2"])
    m = EngineMetrics.from_engine(engine)
    assert (m.num_requests_running, m.num_requests_waiting, m.kv_cache_used_blocks) == (0, 0, 0)
    assert m.e2e_request_latency_seconds.count == 0  # aborted requests are not timed


def test_preemptions_are_counted_and_a_preempted_request_is_timed_once(model_dir):
    events = Preemptions()
    # 3 requests of 8 + 24 tokens need 4 blocks each; 6 blocks hold one and a half of them.
    llm = LLM(model_dir, num_kv_blocks=6, preemption_mode="recompute", enable_prefix_caching=False,
              plugins=[events], **ENGINE)
    ps = prompts(8, 8, 8, seed=2)
    outs = llm.generate(ps, exact(24), use_tqdm=False)
    m = EngineMetrics.from_engine(llm.engine)
    assert m.num_preemptions == events.count == llm.engine.scheduler.num_preemptions > 0
    assert m.time_to_first_token_seconds.count == m.e2e_request_latency_seconds.count == 3
    assert m.prompt_tokens == 24 and m.generation_tokens == sum(len(o.outputs[0].token_ids) for o in outs) == 72
    assert m.kv_cache_used_blocks == 0


def test_prefix_cache_counters(model_dir):
    llm = LLM(model_dir, num_kv_blocks=64, enable_prefix_caching=True, **ENGINE)
    (p,) = prompts(30, seed=3)
    llm.generate([p], exact(2), use_tqdm=False)
    llm.generate([p], exact(2), use_tqdm=False)
    m = EngineMetrics.from_engine(llm.engine)
    assert m.prefix_cache_queries == 2 * 30
    assert m.prefix_cache_hits == 24  # the second time: every full block but the one holding the last token


def test_updates_since_replayed_into_push_only_metrics_equal_each_snapshot(model_dir):
    """What MetricsPublisher does for both doors: set gauges, add counter increases, observe."""
    llm = LLM(model_dir, num_kv_blocks=64, **ENGINE)
    pushed = {(s.name, v): 0.0 for s in METRICS if s.kind != "histogram" for v in s.label_values or [None]}
    observed = {s.name: Histogram(s.buckets) for s in METRICS if s.kind == "histogram"}
    last = None
    for round_ in range(3):
        llm.generate(prompts(6, 11, seed=10 + round_), [exact(3), exact(5)], use_tqdm=False)
        with pytest.raises(InvalidRequestError):  # a rejection and an abort each round: labelled counters move
            llm.engine.add_request(None, [5] * 600, exact(2))
        llm.engine.add_request(f"gone-{round_}", prompts(4)[0], exact(2))
        llm.engine.abort_request(f"gone-{round_}")
        now = EngineMetrics.from_engine(llm.engine)
        for u in now.updates_since(last):
            if u.spec.kind == "gauge":
                pushed[u.spec.name, None] = u.value
            elif u.spec.kind == "counter":
                pushed[u.spec.name, u.label_value] += u.value
            else:
                for _ in range(u.times):
                    observed[u.spec.name].observe(u.value)
        for spec in METRICS:
            want = now.value(spec)
            if spec.kind == "histogram":
                got = observed[spec.name].snapshot()
                assert got.counts == want.counts and got.sum == pytest.approx(want.sum), spec.name
            elif spec.label is not None:
                assert tuple(pushed[spec.name, v] for v in spec.label_values) == want, spec.name
            else:
                assert pushed[spec.name, None] == want, spec.name
        last = now
    reasons = dict(zip(REJECT_REASONS, last.requests_rejected))
    assert reasons["max_input_tokens"] == 3 and sum(last.requests_rejected) == 3
    assert dict(zip(ABORT_REASONS, last.requests_aborted))["client"] == 3
    assert last.time_to_first_token_seconds.count == 6


def test_one_naming_scheme():
    names = [s.name for s in METRICS]
    assert len(set(names)) == len(names) and all(n.startswith("pagedcore:") for n in names)
    # What the Gateway API Inference Extension and vLLM's dashboards read, in vLLM's names.
    for name in ("num_requests_waiting", "num_requests_running", "kv_cache_usage_perc", "prompt_tokens_total",
                 "generation_tokens_total", "num_preemptions_total", "time_to_first_token_seconds",
                 "time_per_output_token_seconds", "e2e_request_latency_seconds"):
        assert "pagedcore:" + name in names
    assert all(s.name.endswith("_total") == (s.kind == "counter") for s in METRICS)
    assert all(s.buckets and list(s.buckets) == sorted(set(s.buckets)) for s in METRICS if s.kind == "histogram")


def test_the_engine_imports_no_metrics_or_server_library():
    code = ("import sys, pagedcore.metrics, pagedcore.llm_engine, pagedcore.async_engine; "
            "bad = [m for m in ('prometheus_client', 'bentoml', 'triton_python_backend_utils', 'fastapi') "
            "if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)

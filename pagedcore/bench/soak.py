"""`pagedcore bench soak`: the front doors under hostile traffic, then a check that nothing leaked.

    pagedcore bench soak --frontend bentoml,triton --requests 1000 --concurrency 64 --cancel-rate 0.2

Each door is launched as its `pagedcore serve-*` command (soak_clients.py holds the clients) and sent
a seeded mix: prompts and output lengths of every size, streaming and not, prompts over the input
limit, clients that cancel (disconnect) at a random moment, and bursts far above the engine's
`max_concurrent_requests`. Every request ends in exactly one of: completed, rejected (by reason:
overload / invalid, as the door said it), cancelled (by this client) or failed (anything else: a 5xx,
a broken stream, an over-long prompt that was accepted, a hang past the request timeout).

After the load the run asserts, through the door's own metrics, that the engine is idle again
(requests running and waiting, KV blocks in use: all 0), that the server still answers, and that its
resident memory grew by less than --max-rss-growth-mb. Exit code 0 only if all of that holds and
nothing failed.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import signal
import sys
import time
import urllib.request
from collections import Counter
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

from pagedcore.bench.serve import Server, descendants_rss, serving_server
from pagedcore.bench.serve_clients import FrontendError
from pagedcore.bench.soak_clients import SOAK_CLIENTS, Outcome, SoakRequest

IDLE_GAUGES = ("pagedcore:num_requests_running", "pagedcore:num_requests_waiting", "pagedcore:kv_cache_used_blocks")
WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches "
         "under pale moonlight near an old stone bridge").split()


@dataclass
class SoakConfig:
    requests: int = 1000
    concurrency: int = 64
    cancel_rate: float = 0.2
    too_long_rate: float = 0.05  # prompts over the input limit: must be refused, never run
    burst_every: int = 100  # every this many requests, a burst ...
    burst_size: int = 64  # ... of this many more, all at once, past the concurrency bound
    max_output: int = 64
    max_input_tokens: int = 256  # the server's limit (its engine setting): over-long prompts exceed it
    request_timeout: float = 120.0  # a request taking longer counts as failed (a hang)
    seed: int = 0


def make_requests(cfg: SoakConfig) -> list[SoakRequest]:
    rng = random.Random(f"soak:{cfg.seed}")
    out = []
    for i in range(cfg.requests):
        too_long = rng.random() < cfg.too_long_rate
        # A word is one to three tokens: a third of the limit in words stays under it.
        n_words = cfg.max_input_tokens * 2 if too_long else rng.choice([1, 4, 16, max(1, cfg.max_input_tokens // 3)])
        out.append(SoakRequest(
            index=i, prompt=" ".join(rng.choice(WORDS) for _ in range(n_words)),
            max_tokens=rng.randint(1, cfg.max_output), stream=rng.random() < 0.5, too_long=too_long,
            cancel_after=rng.uniform(0.0, 2.0) if rng.random() < cfg.cancel_rate else None,
            burst=cfg.burst_every > 0 and i % cfg.burst_every == cfg.burst_every - 1))
    return out


async def run_load(client, requests: list[SoakRequest], cfg: SoakConfig) -> tuple[list[Outcome], float]:
    """`concurrency` requests in flight; a burst request also fires `burst_size` extra copies at once,
    outside that bound (the overload the limits must refuse)."""
    sem = asyncio.Semaphore(cfg.concurrency)
    t0 = time.perf_counter()

    async def bounded(req: SoakRequest) -> list[Outcome]:
        async with sem:
            if not req.burst:
                return [await client.run(req, cfg.request_timeout)]
            # The longest answers, whatever the model says: a burst of short ones could drain as fast
            # as it arrives on a tiny model and never overload anything.
            extra = [SoakRequest(**{**asdict(req), "burst": False, "cancel_after": None,
                                    "max_tokens": cfg.max_output, "ignore_eos": True})
                     for _ in range(cfg.burst_size)]
            return list(await asyncio.gather(*(client.run(r, cfg.request_timeout) for r in [req, *extra])))

    nested = await asyncio.gather(*(bounded(r) for r in requests))
    return [o for group in nested for o in group], time.perf_counter() - t0


def scrape(metrics_url: str) -> dict[str, float]:
    """The engine's unlabelled-by-bucket samples (gauges and counters) from a door's /metrics."""
    with urllib.request.urlopen(metrics_url, timeout=10) as r:
        text = r.read().decode()
    samples: dict[str, float] = {}
    for m in re.finditer(r"^(pagedcore:\w+?)(?:_total)?(?:\{([^}]*)\})? (\S+)$", text, re.M):
        name, labels, value = m.groups()
        if "le=" in (labels or ""):
            continue
        reason = re.search(r'reason="([^"]+)"', labels or "")
        key = name + (f"[{reason.group(1)}]" if reason else "")
        samples[key] = samples.get(key, 0.0) + float(value)
    return samples


def wait_idle(metrics_url: str, timeout: float = 30.0) -> dict[str, float]:
    """The engine's gauges once they are all 0 (doors push metrics every 0.25-0.5 s), or as they
    stand at the timeout."""
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape(metrics_url)
        if all(samples.get(g, 0.0) == 0.0 for g in IDLE_GAUGES) or time.monotonic() > deadline:
            return samples
        time.sleep(0.5)


def summarize(frontend: str, outcomes: list[Outcome], duration: float, after: dict, rss: tuple[int, int],
              still_serving: bool) -> dict:
    kinds = Counter(o.kind for o in outcomes)
    rejected = Counter(o.reason for o in outcomes if o.kind == "rejected")
    failures = [o for o in outcomes if o.kind == "failed"]
    leaks = {g: after.get(g) for g in IDLE_GAUGES if after.get(g, 0.0) != 0.0}
    return {
        "frontend": frontend, "requests": len(outcomes), "duration_s": round(duration, 2),
        "completed": kinds["completed"], "rejected": dict(rejected), "cancelled": kinds["cancelled"],
        "failed": len(failures), "failure_examples": sorted({o.reason for o in failures})[:8],
        "output_tokens": sum(o.output_tokens for o in outcomes),
        "gauges_after": {g: after.get(g) for g in IDLE_GAUGES}, "leaks": leaks,
        "rejected_metrics": {k: v for k, v in after.items() if k.startswith("pagedcore:requests_rejected")},
        "rss_mb_before": round(rss[0] / 2**20, 1), "rss_mb_after": round(rss[1] / 2**20, 1),
        "rss_growth_mb": round((rss[1] - rss[0]) / 2**20, 1), "still_serving": still_serving,
    }


async def soak_one(frontend: str, server: Server, requests: list[SoakRequest], cfg: SoakConfig) -> dict:
    client = SOAK_CLIENTS[frontend](server.url)
    try:
        await client.open()
        warm = await client.run(SoakRequest(-1, "hello", 2, False), cfg.request_timeout)
        if warm.kind != "completed":
            raise FrontendError(f"{frontend}: the warm-up request did not complete: {warm}")
        rss_before = descendants_rss(server.process.pid)
        outcomes, duration = await run_load(client, requests, cfg)
        after = await asyncio.to_thread(wait_idle, server.metrics_url)
        check = await client.run(SoakRequest(-2, "still there?", 4, True), cfg.request_timeout)
        rss_after = descendants_rss(server.process.pid)
    finally:
        await client.close()
    return summarize(frontend, outcomes, duration, after, (rss_before, rss_after), check.kind == "completed")


def passed(result: dict, max_rss_growth_mb: float) -> bool:
    return (result["failed"] == 0 and not result["leaks"] and result["still_serving"]
            and result["rss_growth_mb"] <= max_rss_growth_mb)


def print_result(r: dict, max_rss_growth_mb: float) -> None:
    rejected = ", ".join(f"{k} {v}" for k, v in sorted(r["rejected"].items())) or "0"
    gauges = ", ".join(f"{k.split(':')[1]}={v:g}" for k, v in r["gauges_after"].items() if v is not None)
    print(f"{r['frontend']:8s} {r['requests']:5d} requests in {r['duration_s']:.1f} s: completed {r['completed']}, "
          f"rejected {rejected}, cancelled {r['cancelled']}, failed {r['failed']}; after: "
          f"{gauges}; "
          f"RSS {r['rss_mb_before']:.0f} -> {r['rss_mb_after']:.0f} MiB; still serving: {r['still_serving']}; "
          f"{'PASS' if passed(r, max_rss_growth_mb) else 'FAIL'}")
    for e in r["failure_examples"]:
        print(f"{r['frontend']:8s} failure: {e}")


def engine_settings(args) -> dict:
    from pagedcore.model_loader import resolve_model_dir

    return {"model": str(resolve_model_dir(args.model)), "dtype": args.dtype, "num_threads": args.num_threads,
            "max_num_seqs": args.max_num_seqs, "num_kv_blocks": args.num_kv_blocks,
            "max_model_len": args.max_model_len, "max_concurrent_requests": args.max_concurrent_requests,
            "max_input_tokens": args.max_input_tokens}


def _interrupt(signum, frame):
    raise KeyboardInterrupt  # SIGTERM unwinds like Ctrl-C: through the finally that stops the server


def main(args) -> int:
    frontends = [f.strip() for f in args.frontend.split(",") if f.strip()]
    if not frontends or set(frontends) - set(SOAK_CLIENTS):
        raise ValueError(f"--frontend: expected a comma list of {sorted(SOAK_CLIENTS)}, got {args.frontend!r}")
    if args.requests < 1 or args.concurrency < 1 or not 0 <= args.cancel_rate <= 1:
        raise ValueError("--requests and --concurrency must be >= 1, --cancel-rate in [0, 1]")
    cfg = SoakConfig(requests=args.requests, concurrency=args.concurrency, cancel_rate=args.cancel_rate,
                     burst_every=args.burst_every, burst_size=args.burst_size, max_output=args.max_output,
                     max_input_tokens=args.max_input_tokens, request_timeout=args.request_timeout, seed=args.seed)
    settings = engine_settings(args)
    requests = make_requests(cfg)
    report = {"bench": "soak", "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "model": args.model or "SmolLM2-135M-Instruct (bundled)", "config": asdict(cfg),
              "engine": {k: v for k, v in settings.items() if k != "model"}, "results": []}
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        for frontend in frontends:
            print(f"[bench soak] launching {frontend} ...", file=sys.stderr)
            with serving_server(frontend, settings, args.startup_timeout) as server:
                result = asyncio.run(soak_one(frontend, server, requests, cfg))
            report["results"].append(result)
            print_result(result, args.max_rss_growth_mb)
    except KeyboardInterrupt:
        print("[bench soak] interrupted", file=sys.stderr)
        return 130
    except FrontendError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}", file=sys.stderr)
    return 0 if all(passed(r, args.max_rss_growth_mb) for r in report["results"]) else 1


def add_parser(bsub) -> None:
    p = bsub.add_parser("soak", help="hostile traffic through the front doors (cancels, bursts, over-long "
                                     "prompts), then no leaks, still serving")
    d = SoakConfig()
    p.add_argument("--frontend", default="bentoml,triton", help="bentoml, triton, or both (one after the other)")
    p.add_argument("--requests", type=int, default=d.requests, help="requests in the mix (bursts add more)")
    p.add_argument("--concurrency", type=int, default=d.concurrency, help="requests in flight, bursts aside")
    p.add_argument("--cancel-rate", type=float, default=d.cancel_rate,
                   help="fraction of requests whose client disconnects after a random 0-2 s")
    p.add_argument("--burst-every", type=int, default=d.burst_every, help="every N requests, a burst (0: none)")
    p.add_argument("--burst-size", type=int, default=d.burst_size, help="extra requests in a burst, all at once")
    p.add_argument("--max-output", type=int, default=d.max_output, help="output lengths are drawn from 1..this")
    p.add_argument("--request-timeout", type=float, default=d.request_timeout,
                   help="seconds; a request still open after this counts as failed (a hang)")
    p.add_argument("--max-rss-growth-mb", type=float, default=512.0, help="the server's allowed RSS growth")
    p.add_argument("--seed", type=int, default=d.seed)
    g = p.add_argument_group("launched servers' engine (small limits, so that the load exceeds them)")
    g.add_argument("--model", default=None, help="HF dir or GGUF (default: the bundled SmolLM2)")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    g.add_argument("--num-threads", type=int, default=2, help="torch threads in the server")
    g.add_argument("--max-num-seqs", type=int, default=32)
    g.add_argument("--num-kv-blocks", type=int, default=512)
    g.add_argument("--max-model-len", type=int, default=1024)
    g.add_argument("--max-concurrent-requests", type=int, default=48,
                   help="the engine's admission limit: the bursts go past it")
    g.add_argument("--max-input-tokens", type=int, default=d.max_input_tokens,
                   help="the engine's prompt limit: over-long prompts in the mix go past it")
    p.add_argument("--startup-timeout", type=float, default=180)
    p.add_argument("--json", default=None, help="write the results here")
    p.set_defaults(func=main)

"""`pagedcore bench serve`: online latency and throughput through the front doors, Poisson arrivals.

    pagedcore bench serve --frontend bentoml,triton --num-prompts 64 --request-rate 4 --json serve.json

Each front door (BentoML's OpenAI route, the Triton server) is launched as its `pagedcore serve-*`
command on free loopback ports with the same engine settings, sent the same seeded workload, and
stopped, also on Ctrl-C or an error (the bench is a client: it imports no adapter);
`--url` (or `--no-launch`) measures servers already running instead. Per door: TTFT, TPOT, ITL and
end-to-end latency (mean, p50, p90, p99) and request / output-token throughput. The clients live in
serve_clients.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from pagedcore.bench.serve_clients import (CLIENTS, FrontendError, Request, RequestRecord, arrival_offsets,
                                           bench_frontend)
from pagedcore.bench.workload import Workload, add_workload_args, workload_from_args

# Where `pagedcore serve-bentoml` / `pagedcore serve-triton` listen by default (for --no-launch).
DEFAULT_URLS = {"bentoml": "http://127.0.0.1:3000", "triton": "127.0.0.1:8001"}
PAGEDCORE = [sys.executable, "-m", "pagedcore.cli"]


# ---- launching and stopping a front door --------------------------------------------------------------
@dataclass
class Server:
    process: subprocess.Popen
    url: str  # what the client connects to
    ready_url: str  # HTTP 200 once the model is loaded
    log_path: Path
    metrics_url: str = ""  # Prometheus text: the engine's pagedcore:* metrics


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]  # all bound at once: n distinct ports
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def launch_bentoml(settings: dict, workdir: Path) -> Server:
    """`pagedcore serve-bentoml`; engine settings travel as PAGEDCORE_* variables (all of them,
    num_threads included, which has no flag)."""
    port, = free_ports(1)
    env = {**os.environ, "BENTOML_HOME": str(workdir), "BENTOML_DO_NOT_TRACK": "True",
           "TOKENIZERS_PARALLELISM": "false", **{f"PAGEDCORE_{k.upper()}": str(v) for k, v in settings.items()}}
    cmd = [*PAGEDCORE, "serve-bentoml", "--host", "127.0.0.1", "--port", str(port)]
    base = f"http://127.0.0.1:{port}"
    return Server(spawn(cmd, env, workdir), base, f"{base}/readyz", workdir / "server.log", f"{base}/metrics")


def launch_triton(settings: dict, workdir: Path) -> Server:
    """`pagedcore serve-triton`; engine settings travel as `--set KEY=JSON`. The command starts
    tritonserver in its own process group (the one `spawn` makes), so one group kill stops it all."""
    http, grpc, metrics = free_ports(3)
    cmd = [*PAGEDCORE, "serve-triton", "--http-port", str(http), "--grpc-port", str(grpc),
           "--metrics-port", str(metrics), *(f"--set={k}={json.dumps(v)}" for k, v in settings.items())]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    return Server(spawn(cmd, env, workdir), f"127.0.0.1:{grpc}", f"http://127.0.0.1:{http}/v2/health/ready",
                  workdir / "server.log", f"http://127.0.0.1:{metrics}/metrics")


LAUNCHERS = {"bentoml": launch_bentoml, "triton": launch_triton}


def spawn(cmd: list[str], env: dict, workdir: Path) -> subprocess.Popen:
    with open(workdir / "server.log", "wb") as log:
        return subprocess.Popen(cmd, env=env, cwd=workdir, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)


def wait_ready(server: Server, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise FrontendError(f"the server exited with code {server.process.returncode}:\n{_tail(server.log_path)}")
        try:
            with urllib.request.urlopen(server.ready_url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise FrontendError(f"the server was not ready after {timeout:.0f} s:\n{_tail(server.log_path)}")


def stop(process: subprocess.Popen, timeout: float = 30.0) -> None:
    """SIGTERM to the server (both shut their workers down cleanly), then SIGKILL to whatever of it
    is left: its process group and its descendants (BentoML puts its worker in a session of its own)."""
    family = _descendants(process.pid)
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (process.poll() is None or any(map(_alive, family))):
        time.sleep(0.2)
    leftovers = [(os.killpg, process.pid), *((os.kill, p) for p in family if _alive(p))]
    for kill, pid in leftovers:
        try:
            kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    process.wait()


def _descendants(pid: int) -> set[int]:
    """Every process below `pid`, from /proc (empty where there is none)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def descendants_rss(pid: int) -> int:
    """Resident bytes of a process and everything below it (a server and its workers)."""
    total = 0
    for p in {pid, *_descendants(pid)}:
        try:
            total += int(Path(f"/proc/{p}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, IndexError, ValueError):
            pass
    return total


def _alive(pid: int) -> bool:
    """Running (a zombie, waiting for a parent that may never reap it, counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return "(no log)"


def start(frontend: str, settings: dict, workdir: Path, timeout: float, attempts: int = 3) -> Server:
    """Launch a front door and wait until it is ready. A port chosen free can be taken before the
    server binds it (by another program on the machine): then try again on fresh ports."""
    for attempt in range(1, attempts + 1):
        server = LAUNCHERS[frontend](settings, workdir)
        try:
            wait_ready(server, timeout)
            return server
        except BaseException:
            stop(server.process)
            if attempt == attempts or "already in use" not in _tail(server.log_path):
                raise


@contextmanager
def serving_server(frontend: str, settings: dict, startup_timeout: float):
    """A launched, ready front door; stopped on the way out, whatever happens."""
    with tempfile.TemporaryDirectory(prefix=f"pagedcore-bench-{frontend}-") as tmp:
        server = start(frontend, settings, Path(tmp), startup_timeout)
        try:
            yield server
        finally:
            stop(server.process)


@contextmanager
def serving(frontend: str, settings: dict, startup_timeout: float):
    """A launched front door's client URL (see serving_server)."""
    with serving_server(frontend, settings, startup_timeout) as server:
        yield server.url


# ---- metrics ----------------------------------------------------------------------------------------------
def distribution(seconds: list[float]) -> dict:
    if not seconds:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    ms = np.asarray(seconds) * 1e3
    p50, p90, p99 = np.percentile(ms, [50, 90, 99])
    return {"mean": round(float(ms.mean()), 3), "p50": round(float(p50), 3), "p90": round(float(p90), 3),
            "p99": round(float(p99), 3)}


def summarize(frontend: str, url: str, rate: float, records: list[RequestRecord], duration: float) -> dict:
    ok = [r for r in records if r.error is None]
    out_tokens = sum(r.output_tokens for r in ok)
    ttft = [r.chunk_times[0] - r.start for r in ok]
    # TPOT: the time per output token after the first, request by request (as vLLM defines it).
    tpot = [(r.end - r.chunk_times[0]) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itl = [b - a for r in ok for a, b in zip(r.chunk_times, r.chunk_times[1:])]
    errors = sorted({r.error for r in records if r.error})
    return {"frontend": frontend, "url": url, "request_rate": rate, "num_requests": len(records),
            "completed": len(ok), "failed": len(records) - len(ok), "duration_s": round(duration, 3),
            "requests_s": round(len(ok) / duration, 3), "output_tok_s": round(out_tokens / duration, 2),
            "input_tokens": sum(r.input_tokens for r in ok), "output_tokens": out_tokens,
            "expected_output_tokens": sum(r.output_len for r in ok),
            "length_mismatches": sum(r.output_tokens != r.output_len for r in ok),
            "ttft_ms": distribution(ttft), "tpot_ms": distribution(tpot), "itl_ms": distribution(itl),
            "e2e_ms": distribution([r.end - r.start for r in ok]), "errors": errors[:5]}


def print_report(report: dict) -> None:
    w = report["workload"]
    print(f"\nserve: {w['num_prompts']} requests at {w['request_rate']} req/s (Poisson, seed {w['seed']}), "
          f"input {w['input_len']} output {w['output_len']} tokens; {report['model']}, {report['dtype']}")
    print(f"{'frontend':10s} {'url':28s} {'done':>5s} {'failed':>6s} {'seconds':>8s} {'req/s':>7s} {'out tok/s':>10s}")
    for r in report["results"]:
        print(f"{r['frontend']:10s} {r['url']:28s} {r['completed']:5d} {r['failed']:6d} {r['duration_s']:8.2f} "
              f"{r['requests_s']:7.2f} {r['output_tok_s']:10.1f}")
    print(f"\n{'latency (ms)':20s} {'mean':>9s} {'p50':>9s} {'p90':>9s} {'p99':>9s}")
    fmt = lambda v: f"{v:9.1f}" if v is not None else f"{'-':>9s}"
    for r in report["results"]:
        for name in ("ttft", "tpot", "itl", "e2e"):
            d, label = r[f"{name}_ms"], f"{r['frontend']} {name.upper()}"
            print(f"{label:20s} " + " ".join(fmt(d[k]) for k in ("mean", "p50", "p90", "p99")))
        for e in r["errors"]:
            print(f"{r['frontend']} error: {e}")


# ---- the command ---------------------------------------------------------------------------------------------
def make_requests(args, model_dir: str) -> tuple[Workload, list[Request]]:
    """The seeded token-id workload, decoded to text: Triton's model takes text only, and both doors
    get the very same prompts (input token counts are as each door reports them)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    wl = workload_from_args(args)
    prompts, out_lens = wl.make(len(tok))
    return wl, [Request(tok.decode(p, skip_special_tokens=True), n) for p, n in zip(prompts, out_lens)]


def parse_targets(args) -> list[tuple[str, str | None]]:
    """(frontend, url) pairs; url None means launch one."""
    frontends = [f.strip() for f in args.frontend.split(",") if f.strip()]
    unknown = set(frontends) - set(CLIENTS)
    if unknown or not frontends:
        raise ValueError(f"--frontend: expected a comma list of {sorted(CLIENTS)}, got {args.frontend!r}")
    if args.url:
        urls = args.url.split(",")
        if len(urls) != len(frontends):
            raise ValueError(f"--url: give one URL per frontend ({len(frontends)}), got {len(urls)}")
        return list(zip(frontends, urls))
    return [(f, None if args.launch else DEFAULT_URLS[f]) for f in frontends]


def run_one(frontend: str, url: str | None, settings: dict, requests, offsets, args) -> dict:
    """One door's run; `url` None: launched here (with `settings`) and stopped afterwards."""
    run = lambda u: asyncio.run(bench_frontend(frontend, u, requests, offsets, args.request_timeout))
    if url is not None:
        return {**summarize(frontend, url, args.request_rate, *run(url)), "launched": False}
    print(f"[bench serve] launching {frontend} ...", file=sys.stderr)
    with serving(frontend, settings, args.startup_timeout) as url:
        records, duration = run(url)
    return {**summarize(frontend, url, args.request_rate, records, duration), "launched": True}


def check_args(args) -> None:
    if args.num_prompts < 1 or not args.request_rate > 0:
        raise ValueError("--num-prompts must be >= 1 and --request-rate > 0 (inf: all at once)")


def _interrupt(signum, frame):
    raise KeyboardInterrupt  # SIGTERM unwinds like Ctrl-C: through the finally that stops the server


def main(args) -> int:
    from pagedcore.model_loader import resolve_model_dir

    check_args(args)
    targets = parse_targets(args)
    model_dir = str(resolve_model_dir(args.model))  # converts a GGUF here, never inside a server
    wl, requests = make_requests(args, model_dir)
    offsets = arrival_offsets(len(requests), args.request_rate, random.Random(f"arrivals:{args.seed}"))
    settings = {"model": model_dir, "dtype": args.dtype, "num_threads": args.num_threads,
                "max_num_seqs": args.max_num_seqs, "kv_cache_memory": args.kv_cache_memory,
                "max_model_len": args.max_model_len}
    report = {"bench": "serve", "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "model": args.model or "SmolLM2-135M-Instruct (bundled)", "dtype": args.dtype,
              "engine": {k: v for k, v in settings.items() if k != "model"},
              "workload": {**asdict(wl), "request_rate": args.request_rate, "prompt": "text"}, "results": []}
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        for frontend, url in targets:
            report["results"].append(run_one(frontend, url, settings, requests, offsets, args))
    except KeyboardInterrupt:
        print("[bench serve] interrupted", file=sys.stderr)
        return 130
    except FrontendError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
    print_report(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}", file=sys.stderr)
    return 0 if all(r["failed"] == 0 for r in report["results"]) else 1


def add_parser(bsub) -> None:
    p = bsub.add_parser("serve", help="online latency (TTFT, TPOT, ITL, E2E) and throughput through the front doors")
    p.add_argument("--frontend", default="bentoml", help="bentoml, triton, or bentoml,triton (one after the other)")
    p.add_argument("--url", default=None, help="measure running servers instead (one per frontend, comma list): "
                                               "http://HOST:PORT for bentoml, HOST:GRPC_PORT for triton")
    p.add_argument("--launch", action=argparse.BooleanOptionalAction, default=True,
                   help="start each server on free ports and stop it afterwards (default); --no-launch: "
                        f"use the serve commands' default addresses {DEFAULT_URLS}")
    add_workload_args(p)
    p.add_argument("--request-rate", type=float, default=4.0, help="requests/s, Poisson arrivals; inf: all at once")
    g = p.add_argument_group("launched servers' engine")
    g.add_argument("--model", default=None, help="HF dir or GGUF (default: the bundled SmolLM2)")
    g.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    g.add_argument("--num-threads", type=int, default=2, help="torch threads in the server")
    g.add_argument("--max-num-seqs", type=int, default=128)
    g.add_argument("--kv-cache-memory", type=int, default=1 << 29, help="KV cache bytes (the same for both doors)")
    g.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--startup-timeout", type=float, default=180)
    p.add_argument("--request-timeout", type=float, default=600)
    p.add_argument("--json", default=None, help="write the results here")
    p.set_defaults(func=main)

"""Shared by the peer scripts (imported from the script's own directory, not as pagedcore.*).

SPEC.json: {"mode": "throughput"|"single_stream", "model_dir", "gguf_path", "dtype", "threads",
            "prompts": [[ids]], "output_lens": [n], "options": {...}}
OUT.json:  {"engine", "seconds", "num_requests", "input_tokens", "output_tokens", "extra": {...}}
           or {"engine", "skipped": "why"}.
Single stream: one prompt, streamed; OUT adds "ttft_s" and "tpot_s" (mean time per output token after the first).
"""

from __future__ import annotations

import json
import os
import sys
import time


def load_spec() -> tuple[dict, str]:
    if len(sys.argv) != 3:
        sys.exit(f"usage: {sys.argv[0]} SPEC.json OUT.json")
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    threads = spec.get("threads")
    if threads:
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    return spec, sys.argv[2]


def write(out_path: str, result: dict) -> None:
    with open(out_path, "w") as f:
        json.dump(result, f, indent=2)


def throughput_result(engine: str, seconds: float, prompts, output_tokens: int, **extra) -> dict:
    return {"engine": engine, "seconds": seconds, "num_requests": len(prompts),
            "input_tokens": sum(map(len, prompts)), "output_tokens": output_tokens, "extra": extra}


def stream_timings(engine: str, token_times: list[float], t0: float, **extra) -> dict:
    """From the arrival times of each streamed token: TTFT, and TPOT over the rest."""
    n = len(token_times)
    ttft = token_times[0] - t0
    tpot = (token_times[-1] - token_times[0]) / (n - 1) if n > 1 else float("nan")
    return {"engine": engine, "seconds": token_times[-1] - t0, "num_requests": 1, "output_tokens": n,
            "ttft_s": ttft, "tpot_s": tpot, "extra": extra}


now = time.perf_counter

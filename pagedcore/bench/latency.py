"""Single-stream decode latency and cold start of the engine itself."""

from __future__ import annotations

import subprocess
import sys
import time


def single_stream(engine, prompt: list[int], max_tokens: int) -> dict:
    """One request alone in the engine, stepped by hand: TTFT and time per output token after the first."""
    from pagedcore import SamplingParams

    rid = engine.add_request(None, prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    times, counts, seen, t0 = [], [], 0, time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid and len(out.outputs[0].token_ids) > seen:
                seen = len(out.outputs[0].token_ids)
                times.append(time.perf_counter())
                counts.append(seen)
    # Per token, not per output: a multi-step decode (num_scheduler_steps) hands out several tokens at once.
    tpot = (times[-1] - times[0]) / (counts[-1] - counts[0]) if len(times) > 1 else float("nan")
    return {"engine": "pagedcore", "peer": "pagedcore", "ttft_s": times[0] - t0, "tpot_s": tpot,
            "output_tokens": seen}


def fastest_single_stream(engine, prompt: list[int], max_tokens: int, runs: int = 1, read_probe=None) -> dict:
    """single_stream `runs` times in one engine, the prompt rotated by one token each run (a new first block, so
    no prefix hit shortens a TTFT): the run with the lowest TPOT, with every run's TPOT beside it.

    read_probe (GB/s, e.g. roofline.read_bandwidth_gbs): taken just before and just after each run, the larger kept
    as that run's `read_gbs`, so a TPOT is set against the memory of its own minutes (this host's read bandwidth
    moved 30 -> 53 GB/s between a run's start and its single streams)."""
    from pagedcore.bench.roofline import between_probes

    rows = []
    for k in range(runs):
        rotated = prompt[k % len(prompt):] + prompt[:k % len(prompt)]
        row, gbs = between_probes(lambda: single_stream(engine, rotated, max_tokens), read_probe)
        rows.append(row if gbs is None else dict(row, read_gbs=gbs))
    best = dict(min(rows, key=lambda r: r["tpot_s"]))
    if runs > 1:
        best["tpot_samples_s"] = [r["tpot_s"] for r in rows]
        if "read_gbs" in best:
            best["read_gbs_samples"] = [r["read_gbs"] for r in rows]
    return best


def weight_read_ms(weight_bytes: int, read_gbs: float) -> float:
    return weight_bytes / (read_gbs * 1e9) * 1e3


def single_stream_dtype(settings: dict, dtype: str, prompt: list[int], max_tokens: int, runs: int = 1,
                        read_probe=None) -> dict:
    """The same, on an engine in another dtype (bf16 weights read half the bytes of fp32 ones)."""
    from pagedcore import LLMEngine
    from pagedcore.bench.roofline import weight_bytes

    engine = LLMEngine(**dict(settings, dtype=dtype))
    row = fastest_single_stream(engine, prompt, max_tokens, runs, read_probe)
    return dict(row, engine=f"pagedcore ({dtype} weights)", peer="pagedcore-bf16" if dtype == "bfloat16" else f"pagedcore-{dtype}",
                weight_bytes=weight_bytes(engine.model))


def single_stream_quantized(settings: dict, quantization: str, prompt: list[int], max_tokens: int,
                            runs: int = 1) -> dict:
    """The same, on an engine with 4-bit weights: "int4" (re-quantized by pagedcore) or "gguf" (the
    GGUF file's own Q4 blocks; `settings["model"]` is then the .gguf): what llama.cpp runs on the same file."""
    from pagedcore import LLMEngine

    row = fastest_single_stream(LLMEngine(**dict(settings, quantization=quantization)), prompt, max_tokens, runs)
    # GGUF: its Q4 / Q8_0 blocks as the file stores them (the bundled file's tied head is Q8_0, gguf_native.py)
    label = "int4 weights" if quantization == "int4" else "GGUF blocks as shipped"
    return dict(row, engine=f"pagedcore ({label})", peer=f"pagedcore-{quantization}")


COLD_START = """
import time, sys
t0 = float(sys.argv[1])
from pagedcore import LLM, SamplingParams
llm = LLM(sys.argv[2] or None, dtype=sys.argv[3])
llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
print(time.time() - t0)
"""


def cold_start(model: str | None, dtype: str, runs: int = 3) -> list[float]:
    """Seconds from starting a fresh Python process to the first generated token (imports included;
    the GGUF conversion cache and the C++ build are assumed warm, as after the first run on a
    machine), for each of `runs` fresh processes: the minimum is the figure, as timeit reports."""
    samples = []
    for _ in range(runs):
        t0 = time.time()
        out = subprocess.run([sys.executable, "-c", COLD_START, repr(t0), model or "", dtype],
                             capture_output=True, text=True, check=True)
        samples.append(float(out.stdout.strip().splitlines()[-1]))
    return samples

"""`pagedcore bench throughput`: offline throughput of the engine and its peers, one workload, one run.

pagedcore runs in this process; each peer runs in its own virtualenv (peers.py). Besides throughput,
the run measures what the performance targets need on the same machine at the same time: the
roofline (matmul or weight reads), single-stream decode latency (pagedcore vs llama.cpp), cold start, and KV waste.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone

from pagedcore.bench import latency, roofline, step_profile
from pagedcore.bench.memory import WasteTrace, kv_snapshot
from pagedcore.bench.output import write_json
from pagedcore.hookspecs import hookimpl
from pagedcore.bench.peers import parse_peers, run_peer
from pagedcore.bench.repeats import repeat_offline
from pagedcore.bench.workload import add_workload_args, workload_from_args


@dataclass
class Result:
    engine: str
    peer: str
    seconds: float
    num_requests: int
    input_tokens: int
    output_tokens: int

    def row(self) -> dict:
        d = asdict(self)
        d.update(output_tok_s=round(self.output_tokens / self.seconds, 2),
                 total_tok_s=round((self.input_tokens + self.output_tokens) / self.seconds, 2),
                 requests_s=round(self.num_requests / self.seconds, 3))
        return d


class WasteMeter:
    """Step-end plugin: KV waste over the run, counted as `bench memory` counts it (per physical block)."""

    def __init__(self, engine):
        self.engine = engine
        self.reset()

    def reset(self) -> None:
        self.trace = WasteTrace(self.engine.config.block_size, self.engine.max_model_len)

    @hookimpl
    def pagedcore_step_end(self, stats) -> None:
        self.trace.add(kv_snapshot(self.engine))


def run_pagedcore(prompts, out_lens, settings: dict) -> tuple[Result, object, float]:
    from pagedcore import LLM, SamplingParams

    llm = LLM(**settings)
    meter = WasteMeter(llm.engine)
    llm.engine.pm.register(meter)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in out_lens]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    meter.reset()
    executor = llm.engine.executor
    comm_before = executor.comm_stats() if executor is not None else None
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    if executor is not None:
        llm.tensor_parallel = tensor_parallel_report(comm_before, executor.comm_stats(), dt)
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    return Result("pagedcore", "pagedcore", dt, len(prompts), sum(map(len, prompts)), n_out), llm, meter.trace.mean_pct


def tensor_parallel_report(before: list[dict], after: list[dict], seconds: float) -> dict:
    """Each rank's time in the model's collectives (all-reduce, gathers) over the timed run, per step and
    as a share of the run's wall time; waiting for the slowest rank is part of it."""
    ranks = []
    for b, a in zip(before, after):
        steps = max(a["steps"] - b["steps"], 1) if a["rank"] == 0 else None
        ops = {op: {"calls": v["calls"] - b["by_op"].get(op, {}).get("calls", 0),
                    "seconds": round(v["seconds"] - b["by_op"].get(op, {}).get("seconds", 0.0), 4)}
               for op, v in a["by_op"].items()}
        ranks.append({"rank": a["rank"], "comm_seconds": round(a["comm_seconds"] - b["comm_seconds"], 4),
                      "comm_calls": a["comm_calls"] - b["comm_calls"],
                      "comm_mb": round((a["comm_bytes"] - b["comm_bytes"]) / 1e6, 2), "by_op": ops,
                      **({"steps": steps} if steps else {})})
    steps = ranks[0]["steps"]
    return {"size": len(after), "steps": steps, "run_seconds": round(seconds, 3),
            "comm_ms_per_step": round(ranks[0]["comm_seconds"] / steps * 1e3, 3),
            "step_ms": round(seconds / steps * 1e3, 3),
            "comm_fraction": round(ranks[0]["comm_seconds"] / seconds, 3),
            "collectives_per_step": round(ranks[0]["comm_calls"] / steps, 1), "ranks": ranks}


def peer_row(result: dict) -> dict:
    if "skipped" in result:
        return result
    r = Result(result["engine"], result["peer"], result["seconds"], result["num_requests"],
               result["input_tokens"], result["output_tokens"]).row()
    r["environment"] = result.get("environment")
    if result.get("extra"):  # the peer's own settings (threads, precisions, conversion time...)
        r["extra"] = result["extra"]
    return r


BEST_PEERS = ("openvino", "vllm")  # the strongest CPU engines with continuous batching
PROFILE_REPEATS = 3  # fresh batches per decode-stack profile row, the fastest reported


def targets(report: dict) -> list[dict]:
    """The issue's performance targets (issue 13), each with its measured value (absent peers: not assessed)."""
    ratios, rows = report["ratios"], []

    def add(name, value, target, met, **extra):
        rows.append({"name": name, "value": None if value is None else round(value, 3), "target": target,
                     "met": None if value is None else bool(met), **extra})

    # pagedcore / max(peer tok/s) is the smallest of pagedcore's ratios to those peers.
    measured = {p: ratios[p] for p in BEST_PEERS if ratios.get(p) is not None}
    best = min(measured, key=measured.get) if measured else None
    v = measured.get(best)
    add("output tok/s vs best CPU peer", v, ">= 1.3x", v is not None and v >= 1.3, peer=best)
    v = ratios.get("hf-cb")
    add("output tok/s vs hf-cb", v, ">= 1.5x", v is not None and v >= 1.5)
    roof = report.get("roofline", {}).get("fraction")
    add("fraction of the roofline (matmul or weight reads)", roof, ">= 0.75", roof is not None and roof >= 0.75)
    single = {r["peer"]: r for r in report.get("single_stream", []) if "tpot_s" in r}
    ratio = (single["pagedcore-int4"]["tpot_s"] / single["llama-cpp"]["tpot_s"]
             if {"pagedcore-int4", "llama-cpp"} <= set(single) else None)
    add("single-stream TPOT pagedcore-int4 / llama.cpp's", ratio, "<= 1.0x", ratio is not None and ratio <= 1.0)
    ratio = (single["pagedcore-gguf"]["tpot_s"] / single["llama-cpp"]["tpot_s"]
             if {"pagedcore-gguf", "llama-cpp"} <= set(single) else None)
    add("single-stream TPOT pagedcore-gguf / llama.cpp's", ratio, "<= 1.0x", ratio is not None and ratio <= 1.0)
    # bf16 weights: the run's own engine when it runs bf16, else the extra bf16 single-stream row.
    bf16 = "pagedcore" if report.get("dtype") == "bfloat16" else "pagedcore-bf16"
    # Against the reads timed beside the stream where the run has them, else the run's start-up probe.
    read_ms = single.get(bf16, {}).get("weight_read_ms") or (
        report.get("roofline", {}).get("weight_read_ms") if bf16 == "pagedcore" else None)
    ratio = single[bf16]["tpot_s"] * 1e3 / read_ms if bf16 in single and read_ms else None
    add("single-stream bf16 TPOT / weight-read time", ratio, "<= 1.5x", ratio is not None and ratio <= 1.5)
    step = next((r for r in report.get("step_profile", []) if r.get("batch") == 64), None)
    matmul = step.get("matmul_ms") if step else None
    v = round(step["step_ms"] / matmul, 3) if matmul else None
    add("decode step at 64 sequences / its matmul at peak", v, "<= 1.3x", v is not None and v <= 1.3)
    # Where reading the weights and the K/V once takes longer than the matmul (AMX CPUs), that is the floor.
    floor = max(matmul, step["weight_read_ms"] + step.get("kv_read_ms", 0)) if matmul else None
    v = round(step["step_ms"] / floor, 3) if floor else None
    add("decode step at 64 sequences / max(matmul, weight + K/V reads)", v, "<= 1.3x", v is not None and v <= 1.3)
    cold = report.get("cold_start_s")
    add("cold start to first token (s)", cold, "< 5 s", cold is not None and cold < 5)
    waste = report.get("kv_waste_pct")
    add("KV waste (% of allocated slots)", waste, "< 4%", waste is not None and waste < 4)
    return rows


def print_report(report: dict) -> None:
    w = report["workload"]
    print(f"\nworkload: {w['num_prompts']} prompts, input {w['input_len']}, output {w['output_len']} tokens, "
          f"seed {w['seed']}; dtype {report['dtype']}; torch threads {report['machine']['threads']}")
    base = report["results"][0]["output_tok_s"]
    print(f"{'engine':44s} {'out tok/s':>10s} {'total tok/s':>12s} {'req/s':>8s} {'pagedcore x':>12s}")
    for r in report["results"]:
        if "skipped" in r:
            print(f"{r['engine']:44s} skipped: {r['skipped']}")
            continue
        print(f"{r['engine']:44s} {r['output_tok_s']:10.1f} {r['total_tok_s']:12.1f} {r['requests_s']:8.2f} "
              f"{base / r['output_tok_s']:12.2f}")
        if len(r.get("seconds_samples", [])) > 1:
            print(f"{'':44s} fastest of {len(r['seconds_samples'])} runs: "
                  f"{', '.join(f'{x:.2f}' for x in r['seconds_samples'])} s")
        if r.get("extra", {}).get("precision_fallback"):
            print(f"{'':44s} note: {r['extra']['precision_fallback']}")
    for r in report.get("single_stream", []):
        if "skipped" in r:
            print(f"single stream {r['engine']}: skipped: {r['skipped']}")
        else:
            runs = r.get("tpot_samples_s", [])
            seen = f" (fastest of {len(runs)}: {', '.join(f'{x * 1e3:.2f}' for x in runs)})" if len(runs) > 1 else ""
            read = (f"; its weights read in {r['weight_read_ms']:.2f} ms at {r['read_gbs']:.1f} GB/s timed beside it"
                    if r.get("weight_read_ms") and r.get("read_gbs") else "")
            print(f"single stream {r['engine']}: TTFT {r['ttft_s'] * 1e3:.1f} ms, TPOT {r['tpot_s'] * 1e3:.2f} ms{seen}{read}")
    if "roofline" in report:
        rf = report["roofline"]
        print(f"roofline: matmul {rf['matmul_tflops']:.2f} TFLOP/s; pagedcore {rf['achieved_tflops']:.3f} TFLOP/s "
              f"= {100 * rf.get('matmul_fraction', rf['fraction']):.1f}% ({rf['model_gflop_per_token']:.3f} GFLOP/token)")
        if "roofline_s" in rf:
            print(f"roofline: the run needs >= {rf['compute_s']:.2f} s of matmul at peak and >= {rf['memory_s']:.2f} s "
                  f"of weight reads ({rf['min_passes']} passes); pagedcore at {100 * rf['fraction']:.1f}% of the larger")
        if "weight_read_ms" in rf:
            print(f"roofline: memory read {rf['read_gbs']:.1f} GB/s; all {rf['weight_mb']:.0f} MB of weights "
                  f"read in {rf['weight_read_ms']:.2f} ms (single-stream TPOT floor)")
    if report.get("tensor_parallel"):
        t = report["tensor_parallel"]
        print(f"tensor parallel {t['size']} ranks: {t['steps']} steps, {t['step_ms']:.2f} ms per step, of which "
              f"{t['comm_ms_per_step']:.2f} ms in collectives on rank 0 ({100 * t['comm_fraction']:.1f}% of the run; "
              f"{t['collectives_per_step']:.0f} per step)")
        for r in t["ranks"]:
            ops = ", ".join(f"{op} {v['calls']} x {1e3 * v['seconds'] / max(v['calls'], 1):.3f} ms"
                            for op, v in r["by_op"].items())
            print(f"  rank {r['rank']}: {r['comm_seconds']:.3f} s in collectives ({r['comm_mb']:.1f} MB): {ops}")
    if report.get("step_profile"):
        print(f"decode step profile (ms per forward; the decode stack's rows the fastest of {PROFILE_REPEATS} batches):")
        print("\n".join(step_profile.format_rows(report["step_profile"])))
    for t in report.get("targets", []):
        state = "n/a" if t["met"] is None else "met" if t["met"] else "NOT met"
        print(f"target {t['name']}: {t['value']} (want {t['target']}): {state}")


def bundled_gguf_path_or_none(model: str | None) -> str | None:
    """The bundled GGUF when the run is on the bundled model (what llama.cpp and the GGUF-native engine read)."""
    from pagedcore.model_loader import bundled_gguf_path

    try:
        return str(bundled_gguf_path()) if model is None else None
    except FileNotFoundError:
        return None


def main(args) -> int:
    import torch
    from transformers import AutoConfig

    from pagedcore.model_loader import resolve_model_dir

    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    threads = torch.get_num_threads()
    peers = parse_peers(args.peers)
    model_dir = str(resolve_model_dir(args.model))
    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    wl = workload_from_args(args)
    prompts, out_lens = wl.make(vocab)
    if args.dtype == "auto":
        args.dtype = "bfloat16" if roofline.cpu_has_bf16_units() else "float32"
        print(f"[bench] dtype auto -> {args.dtype}", file=sys.stderr)
    dtype = getattr(torch, args.dtype)

    report = {"bench": "throughput", "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "machine": {"cpu": _cpu_name(), "cores": os.cpu_count(), "torch": torch.__version__,
                          "threads": threads, "arch": platform.machine()},
              "model": args.model or "SmolLM2-135M-Instruct (bundled)", "dtype": args.dtype, "workload": asdict(wl)}
    if args.roofline:
        tflops = roofline.matmul_tflops(dtype)
        read_gbs = roofline.read_bandwidth_gbs()
    settings = dict(model=model_dir, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
                    max_num_batched_tokens=args.max_num_batched_tokens)
    if args.structured:  # the cost of constrained decoding, alone (structured.py)
        from pagedcore.bench import structured

        report.update(structured.run(settings, prompts, out_lens))
        structured.print_report(report)
        write_json(report, args.json)
        return 0
    tp = args.tensor_parallel_size
    if tp > 1:
        # The engine's model is rank 0's shard: the whole-model measurements (roofline, step profile, the extra
        # single-stream engines, cold start) stay TP=1 measurements; run them without the flag.
        settings.update(tensor_parallel_size=tp, num_threads=args.num_threads)
        os.environ["PAGEDCORE_TP_SYNC_TIMING"] = "1"  # CUDA: time each collective to its end (comm.py)
        args.roofline = args.step_profile = args.int4_stream = args.cold_start = False
        print(f"[bench] tensor_parallel_size {tp}: roofline, step profile, cold start and the extra single-stream "
              "engines are off (TP=1 measurements)", file=sys.stderr)
    ours, llm, waste = run_pagedcore(prompts, out_lens, settings)
    report["results"] = [ours.row()]
    report["kv_waste_pct"] = round(waste, 3)
    if tp > 1:
        report["tensor_parallel"] = llm.tensor_parallel
    if args.roofline:
        gflop, achieved = roofline.achieved(llm.engine.model, ours.input_tokens, ours.output_tokens, ours.seconds)
        per_token = sum(roofline.model_flops(llm.engine.model)) / 1e9
        report["roofline"] = {"matmul_tflops": tflops, "model_gflop_per_token": per_token,
                              "achieved_tflops": achieved, "fraction": achieved / tflops}
        weights = roofline.weight_bytes(llm.engine.model)
        report["roofline"].update(read_gbs=read_gbs, weight_mb=weights / 1e6,
                                  weight_read_ms=weights / (read_gbs * 1e9) * 1e3)
        bound = roofline.workload_seconds(llm.engine.model, ours.input_tokens, out_lens,
                                          llm.engine.config.max_num_seqs, tflops, read_gbs)
        report["roofline"].update(bound, matmul_fraction=achieved / tflops, fraction=bound["roofline_s"] / ours.seconds)
    stream_prompt, stream_len = prompts[0][:args.stream_input], args.stream_output
    runs = args.repeats
    # The single streams' weight-read floor from reads timed beside them (latency.fastest_single_stream).
    probe = roofline.adjacent_read_gbs if args.roofline else None
    single = [latency.fastest_single_stream(llm.engine, stream_prompt, stream_len, runs, probe)] \
        if args.single_stream else []
    if single and probe is not None:
        single[0]["weight_read_ms"] = latency.weight_read_ms(weights, single[0]["read_gbs"])
    if args.step_profile:
        report["step_profile"] = step_profile.run(llm.engine, args.profile_batches, read_gbs if args.roofline else None,
                                                  tflops if args.roofline else None, repeats=PROFILE_REPEATS,
                                                  read_probe=probe)
    llm.shutdown()
    del llm
    if args.single_stream and args.dtype != "bfloat16" and tp == 1:
        row = latency.single_stream_dtype(settings, "bfloat16", stream_prompt, stream_len, runs, probe)
        if args.roofline:
            row["weight_read_ms"] = latency.weight_read_ms(row.pop("weight_bytes"), row["read_gbs"])
        single.append(row)
    if args.single_stream and args.int4_stream:
        single.append(latency.single_stream_quantized(settings, "int4", stream_prompt, stream_len, runs))
    gguf_path = bundled_gguf_path_or_none(args.model)
    if args.single_stream and args.int4_stream and gguf_path:
        # bf16 for what the file keeps outside its Q4 linears (the tied Q8_0 embedding/head, 8.5 bits a
        # weight in llama.cpp): the nearest the engine holds it; fp32 would read 4x llama.cpp's head bytes.
        single.append(latency.single_stream_quantized(dict(settings, model=gguf_path, dtype="bfloat16"), "gguf",
                                                      stream_prompt, stream_len, runs))

    spec = {"model_dir": model_dir, "dtype": args.dtype, "threads": threads, "prompts": prompts,
            "output_lens": out_lens, "mode": "throughput",
            "options": {"batch_size": args.hf_batch_size, "max_num_seqs": args.max_num_seqs,
                        "max_num_batched_tokens": args.max_num_batched_tokens}}
    spec["gguf_path"] = gguf_path
    for peer in peers:
        if peer.name == "llama-cpp" and not spec["gguf_path"]:
            report["results"].append({"engine": peer.label, "peer": peer.name, "skipped": "needs the bundled GGUF"})
            continue
        report["results"].append(peer_row(run_peer(peer, spec, timeout=args.peer_timeout)))
        if peer.name == "llama-cpp" and args.single_stream:
            stream_spec = dict(spec, mode="single_stream", prompts=[stream_prompt], output_lens=[stream_len])
            streams = [run_peer(peer, stream_spec, timeout=args.peer_timeout) for _ in range(runs)]
            timed = [r for r in streams if "tpot_s" in r]
            single.append(dict(min(timed, key=lambda r: r["tpot_s"]), tpot_samples_s=[r["tpot_s"] for r in timed])
                          if len(timed) > 1 else streams[0])
    report["single_stream"] = single
    if args.repeats > 1:
        def run_ours() -> dict:
            result, engine, _ = run_pagedcore(prompts, out_lens, settings)
            engine.shutdown()
            return result.row()

        repeat_offline(report, args.repeats - 1, run_ours,
                       lambda peer: peer_row(run_peer(peer, spec, timeout=args.peer_timeout)), peers)
    report["ratios"] = {r["peer"]: round(report["results"][0]["output_tok_s"] / r["output_tok_s"], 3)
                        for r in report["results"][1:] if "output_tok_s" in r}
    if args.cold_start:
        samples = latency.cold_start(args.model, args.dtype)
        report["cold_start_s"] = round(min(samples), 3)
        report["cold_start_samples_s"] = [round(x, 3) for x in samples]
    report["targets"] = targets(report)
    print_report(report)
    write_json(report, args.json)
    return 0




def _at_least_one(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


def add_parser(bsub) -> None:
    t = bsub.add_parser("throughput", help="offline throughput on random token-id prompts, against peers")
    t.add_argument("--model", default=None, help="HF dir or GGUF (default: the bundled SmolLM2)")
    t.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="every engine's dtype; auto: bfloat16 where the CPU has bf16 matmul units (AVX-512 BF16, "
                        "AMX), else float32 (torch's bf16 matmul is a scalar loop there, and peers compute in fp32)")
    add_workload_args(t)
    t.add_argument("--max-num-seqs", type=int, default=128)
    t.add_argument("--max-num-batched-tokens", type=int, default=2048)
    t.add_argument("--num-threads", type=int, default=None,
                   help="torch threads (default: torch's; with --tensor-parallel-size, per rank: the cores / ranks)")
    t.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="shard pagedcore's model over N ranks (spawned workers) and report the time in collectives")
    t.add_argument("--peers", default="", help="comma list of hf-static, hf-cb, vllm, llama-cpp, openvino, or all")
    t.add_argument("--hf-batch-size", type=int, default=32, help="batch size of the hf-static peer")
    t.add_argument("--peer-timeout", type=float, default=3600)
    t.add_argument("--repeats", type=_at_least_one, default=1,
                   help="run the offline workload this many times per engine (fresh engines and peer processes, "
                        "alternating) and report each engine's fastest run with all runs' seconds")
    t.add_argument("--no-roofline", dest="roofline", action="store_false")
    t.add_argument("--no-single-stream", dest="single_stream", action="store_false")
    t.add_argument("--stream-input", type=int, default=128, help="single-stream prompt tokens")
    t.add_argument("--stream-output", type=int, default=128, help="single-stream output tokens")
    t.add_argument("--no-int4-stream", dest="int4_stream", action="store_false",
                   help="skip the single-stream runs with 4-bit weights (int4, and the bundled GGUF's own "
                   "blocks: the 4-bit comparisons with llama.cpp)")
    t.add_argument("--no-cold-start", dest="cold_start", action="store_false")
    t.add_argument("--no-step-profile", dest="step_profile", action="store_false",
                   help="skip the decode step profile (prepare / GEMMs / attention / ... at --profile-batches)")
    t.add_argument("--profile-batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 64])
    t.add_argument("--json", default=None, help="write results here")
    t.add_argument("--structured", choices=["json"], default=None,
                   help="measure constrained decoding instead: tok/s with vs without a JSON schema per request, "
                        "grammar compile time p50/p99 (no peers)")
    t.set_defaults(func=main)

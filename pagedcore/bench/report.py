"""`pagedcore bench report`: Markdown tables from the bench JSON files, printed or put into a README.

`--readme FILE` replaces what lies between `<!-- bench:start -->` and `<!-- bench:end -->` in FILE, so
the published numbers are always the ones a JSON file holds. Any key but a throughput file's
"results" may be missing (older or smoke runs): render what is there.
"""

from __future__ import annotations

import json
import sys

START, END = "<!-- bench:start -->", "<!-- bench:end -->"
DASH = "–"


def _num(v, fmt: str = "{:.1f}") -> str:
    return DASH if v is None else fmt.format(v)


def _cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")  # peer errors may hold pipes


def _table(header: list[str], rows: list[list[str]], align: str) -> list[str]:
    """`align`: one of l / r per column."""
    sep = ["---:" if a == "r" else "---" for a in align]
    return ["| " + " | ".join(header) + " |", "| " + " | ".join(sep) + " |",
            *("| " + " | ".join(_cell(c) for c in row) + " |" for row in rows)]


def _setting(throughput: dict) -> str:
    parts = [throughput.get("model"), throughput.get("dtype")]
    w = throughput.get("workload")
    if w:
        parts.append(f"{w['num_prompts']} prompts, input {w['input_len'][0]}-{w['input_len'][1]}, output "
                     f"{w['output_len'][0]}-{w['output_len'][1]} tokens (seed {w.get('seed', 0)})")
    m = throughput.get("machine")
    if isinstance(m, dict):
        parts.append(f"{m.get('cpu', '?')}, {m.get('threads', '?')} threads, torch {m.get('torch', '?')}")
    elif m:
        parts.append(str(m))
    if throughput.get("created"):
        parts.append(throughput["created"][:10])
    return "; ".join(str(p) for p in parts if p)


def _speedup(row: dict, throughput: dict, base: float | None) -> float | None:
    """pagedcore's output tok/s over this row's: the run's own ratio, else computed."""
    peer = row.get("peer")
    if peer in throughput.get("ratios", {}):
        return throughput["ratios"][peer]
    if base is None or not row.get("output_tok_s"):
        return None
    return base / row["output_tok_s"]


def throughput_table(throughput: dict) -> list[str]:
    rows = throughput["results"]
    ours = next((r for r in rows if r.get("peer", r["engine"]) == "pagedcore" and "skipped" not in r), None)
    base = ours["output_tok_s"] if ours else None
    body = []
    for r in rows:
        if "skipped" in r:
            body.append([r["engine"], DASH, DASH, DASH, DASH, f"skipped: {r['skipped']}"])
            continue
        env, samples = r.get("environment"), r.get("seconds_samples", [])
        notes = [f"ran in {env}"] if env else []
        if len(samples) > 1:
            notes.append(f"fastest of {len(samples)} runs: {', '.join(f'{x:.2f}' for x in samples)} s")
        body.append([r["engine"], _num(r.get("output_tok_s")), _num(r.get("total_tok_s")),
                     _num(r.get("requests_s"), "{:.2f}"), _num(_speedup(r, throughput, base), "{:.2f}x"),
                     "; ".join(notes)])
    return [f"**Offline throughput**: {_setting(throughput)}", "",
            *_table(["engine", "output tok/s", "total tok/s", "req/s", "pagedcore x", "notes"], body, "lrrrrl")]


def single_stream_table(rows: list[dict]) -> list[str]:
    def notes(r: dict) -> str:
        runs, notes = r.get("tpot_samples_s", []), []
        if len(runs) > 1:
            notes.append(f"fastest TPOT of {len(runs)} runs: {', '.join(f'{x * 1e3:.2f}' for x in runs)} ms")
        if r.get("weight_read_ms") and r.get("read_gbs"):
            notes.append(f"weights read in {r['weight_read_ms']:.2f} ms at {r['read_gbs']:.1f} GB/s timed beside it")
        return "; ".join(notes)

    body = [[r["engine"], DASH, DASH, f"skipped: {r['skipped']}"] if "skipped" in r else
            [r["engine"], _num(r["ttft_s"] * 1e3), _num(r["tpot_s"] * 1e3, "{:.2f}"), notes(r)] for r in rows]
    return ["**Single stream** (one request alone in the engine)", "",
            *_table(["engine", "TTFT ms", "TPOT ms", "notes"], body, "lrrl")]


def extra_lines(throughput: dict) -> list[str]:
    lines = []
    rf = throughput.get("roofline")
    if rf and rf.get("read_gbs"):
        lines.append(f"- Memory: {rf['read_gbs']:.1f} GB/s read; all {rf['weight_mb']:.0f} MB of weights in "
                     f"{rf['weight_read_ms']:.1f} ms")
    if rf:
        matmul = rf.get("matmul_fraction", rf["fraction"])
        lines.append(f"- Matmul: {rf['achieved_tflops']:.3f} TFLOP/s achieved of {rf['matmul_tflops']:.2f} TFLOP/s "
                     f"measured matmul peak = {100 * matmul:.1f}% ({rf['model_gflop_per_token']:.3f} GFLOP/token)")
    if rf and "roofline_s" in rf:
        lines.append(f"- Roofline: the run needs >= {rf['compute_s']:.2f} s of matmul at peak and >= "
                     f"{rf['memory_s']:.2f} s of weight reads ({rf['min_passes']} forward passes, each reading every "
                     f"weight); pagedcore ran at {100 * rf['fraction']:.1f}% of the larger")
    if throughput.get("cold_start_s") is not None:
        samples = throughput.get("cold_start_samples_s")
        seen = f" (min of {len(samples)} fresh processes: {', '.join(f'{x:.2f}' for x in samples)})" if samples else ""
        lines.append(f"- Cold start, fresh process to first token: {throughput['cold_start_s']:.2f} s{seen}")
    if throughput.get("kv_waste_pct") is not None:
        lines.append(f"- KV waste, allocated but empty slots over the run: {throughput['kv_waste_pct']:.2f}%")
    return lines


def step_profile_table(rows: list[dict]) -> list[str]:
    from pagedcore.bench.step_profile import PARTS, with_layered

    body = [[str(r["batch"]), r["path"], _num(r["step_ms"], "{:.2f}"), *(_num(r.get(p), "{:.2f}") for p in PARTS),
             _num(r.get("weight_read_ms"), "{:.2f}") + (f" at {r['read_gbs']:.1f} GB/s" if r.get("read_gbs") else ""),
             _num(r.get("kv_read_ms"), "{:.2f}"),
             _num(r.get("matmul_ms"), "{:.2f}")] for r in with_layered(rows)]
    header = ["batch", "path", "step", "prepare", "GEMMs", "attention", "other forward", "sample", "output",
              "floor: read weights", "floor: read K/V", "floor: matmul at peak"]
    probed = ", the reads at the bandwidth probed just before and after each batch's profile" \
        if any(r.get("read_gbs") for r in rows) else ""
    return [f"**Decode step profile** (ms per step, a forward's: a multi-step decode's engine step runs "
            f"num_scheduler_steps of them and its parts outside the forward are shared; floors measured in the same "
            f"run{probed}; the decode stack runs every "
            "layer in one C++ call and times its own phases, each up to the barrier that ends it: attention there is "
            "RoPE, the cache write and paged attention; its GEMMs include the LM head)", "",
            *_table(header, body, "rlrrrrrrrrrr")]


def targets_table(targets: list[dict]) -> list[str]:
    def status(t):
        return "not assessed" if t.get("met") is None else "met" if t["met"] else "**not met**"

    body = [[t["name"], t["target"], _num(t.get("value"), "{:g}"), status(t)] for t in targets]
    return ["**Performance targets**", "", *_table(["target", "want", "measured", "status"], body, "llrl")]


def serve_table(serve: dict) -> list[str]:
    def ms(r, metric, pct):
        return _num(r.get(metric, {}).get(pct), "{:.0f}")

    body = [[r["frontend"], f"{r['request_rate']:g}", f"{r.get('completed', DASH)}/{r.get('failed', DASH)}",
             _num(r.get("requests_s"), "{:.2f}"), _num(r.get("output_tok_s")),
             ms(r, "ttft_ms", "p50"), ms(r, "ttft_ms", "p99"), ms(r, "tpot_ms", "p50"),
             ms(r, "e2e_ms", "p50"), ms(r, "e2e_ms", "p99")] for r in serve.get("results", [])]
    header = ["front door", "req/s offered", "done/failed", "req/s", "out tok/s", "TTFT p50 ms", "TTFT p99 ms",
              "TPOT p50 ms", "E2E p50 ms", "E2E p99 ms"]
    return ["**Serving** (Poisson arrivals through the front doors)", "", *_table(header, body, "lrrrrrrrrr")]


def memory_table(memory: dict) -> list[str]:
    from pagedcore.bench.memory import table_rows

    w = memory.get("workload", {})
    setting = f"{memory.get('model', '')}, {memory.get('dtype', '')}"
    if w:
        setting += f"; {w['num_prompts']} prompts, input {w['input_len'][0]}-{w['input_len'][1]}, " \
                   f"output {w['output_len'][0]}-{w['output_len'][1]} tokens"
    return [f"**KV memory**: {setting}", "", *_table(["measurement", "result"], table_rows(memory), "lr")]


def render(throughput: dict | None, serve: dict | None = None, memory: dict | None = None) -> str:
    sections = []
    if throughput:
        sections.append(throughput_table(throughput))
        if throughput.get("single_stream"):
            sections.append(single_stream_table(throughput["single_stream"]))
        if throughput.get("step_profile"):
            sections.append(step_profile_table(throughput["step_profile"]))
        if extra_lines(throughput):
            sections.append(extra_lines(throughput))
        if throughput.get("targets"):
            sections.append(targets_table(throughput["targets"]))
    if serve:
        sections.append(serve_table(serve))
    if memory:
        sections.append(memory_table(memory))
    return "\n\n".join("\n".join(s) for s in sections) + "\n"


def replace_between_markers(text: str, block: str) -> str:
    start, end = text.find(START), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"no `{START}` ... `{END}` markers (in that order) to put the report between")
    return text[:start + len(START)] + "\n" + block.rstrip("\n") + "\n" + text[end:]


def load_json(path: str | None) -> dict | None:
    if path is None:
        return None
    with open(path) as f:
        return json.load(f)


def main(args) -> int:
    if not (args.throughput or args.serve or args.memory):
        raise ValueError("give at least one of --throughput, --serve, --memory")
    text = render(load_json(args.throughput), load_json(args.serve), load_json(args.memory))
    if not args.readme:
        print(text, end="")
        return 0
    with open(args.readme) as f:
        readme = f.read()
    updated = replace_between_markers(readme, text)  # raises before anything is written
    with open(args.readme, "w") as f:
        f.write(updated)
    print(f"updated {args.readme}", file=sys.stderr)
    return 0


def add_parser(bsub) -> None:
    p = bsub.add_parser("report", help="Markdown tables from bench JSON (stdout, or into a README)")
    p.add_argument("--throughput", default=None, help="JSON from `pagedcore bench throughput`")
    p.add_argument("--serve", default=None, help="JSON from `pagedcore bench serve`")
    p.add_argument("--memory", default=None, help="JSON from `pagedcore bench memory`")
    p.add_argument("--readme", default=None, help=f"replace the text between {START} and {END} in this file")
    p.set_defaults(func=main)

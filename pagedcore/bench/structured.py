"""`pagedcore bench throughput --structured json`: what constrained decoding costs.

The same prompts and output lengths run on one engine (prefix caching off), greedy, alternating best of `repeats`: unconstrained (ignore_eos), and
each request constrained by its own JSON schema (nested objects, enums, integer bounds, required,
`additionalProperties: false`). The schemas ask for more records than any output holds, so the
grammar never completes and every request, constrained or not, generates exactly its output length:
the two tok/s compare the same work. Grammars compile first (each schema differs: no cache hits) and
their compile times are reported apart; the timed constrained run finds them compiled.
"""

from __future__ import annotations

import statistics
import sys
import time
from concurrent.futures import wait


def schema(i: int) -> dict:
    """Request i's schema: distinct per request (its own enum), never complete within max_tokens."""
    record = {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 99999},
        "kind": {"enum": [f"k{i}a", f"k{i}b", f"k{i}c"]},
        "ok": {"type": "boolean"},
        "where": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -100, "maximum": 100},
                                                   "y": {"type": "integer", "minimum": -100, "maximum": 100}},
                  "required": ["x", "y"], "additionalProperties": False}},
        "required": ["id", "kind", "ok", "where"], "additionalProperties": False}
    return {"type": "object", "properties": {"records": {"type": "array", "items": record, "minItems": 100000}},
            "required": ["records"], "additionalProperties": False}


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def run(settings: dict, prompts: list, out_lens: list[int], repeats: int = 2) -> dict:
    from pagedcore import LLM, SamplingParams

    # No prefix caching: the second run would find the first run's prompts cached and skip their prefill.
    llm = LLM(**dict(settings, enable_prefix_caching=False))
    free = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in out_lens]
    constrained = [SamplingParams(temperature=0, max_tokens=n, structured_outputs={"json": schema(i)})
                   for i, n in enumerate(out_lens)]
    llm.generate(prompts[:2], free[:2], use_tqdm=False)  # warm-up
    manager = llm.engine.structured_output
    manager.backend  # built once per engine (the tokenizer's tables): not a grammar's compile time
    t0 = time.perf_counter()
    wait([llm.engine.compile_grammar(p) for p in constrained])
    compile_wall = time.perf_counter() - t0
    compile_ms = [t * 1e3 for t in manager.compile_times]

    rows = {}
    for _ in range(repeats):  # alternating, the best of each: machine noise hits both alike
        for name, params in (("unconstrained", free), ("json", constrained)):
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - t0
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            print(f"[bench] {name}: {tokens} tokens in {seconds:.2f} s", file=sys.stderr)
            if name not in rows or seconds < rows[name]["seconds"]:
                rows[name] = {"seconds": round(seconds, 3), "output_tokens": tokens,
                              "output_tok_s": round(tokens / seconds, 2),
                              "finish_reasons": sorted({o.outputs[0].finish_reason for o in outs})}
    llm.shutdown()
    ratio = rows["json"]["output_tok_s"] / rows["unconstrained"]["output_tok_s"]
    return {"structured": "json", "num_requests": len(prompts), "repeats": repeats, "prefix_caching": False, "max_num_seqs": settings.get("max_num_seqs"),
            "runs": rows, "constrained_over_unconstrained": round(ratio, 3), "cost_pct": round((1 - ratio) * 100, 2),
            "compile_ms": {"count": len(compile_ms), "p50": round(statistics.median(compile_ms), 2),
                           "p99": round(_percentile(compile_ms, 0.99), 2), "max": round(max(compile_ms), 2),
                           "wall_s_all": round(compile_wall, 3)},
            "target": {"name": "constrained decoding cost (compiled grammars)", "value_pct": round((1 - ratio) * 100, 2),
                       "want": "<= 10%", "met": bool(ratio >= 0.9)}}


def print_report(report: dict) -> None:
    for name, r in report["runs"].items():
        print(f"{name:>14}: {r['output_tok_s']:10.1f} output tok/s  ({r['output_tokens']} tokens, {r['seconds']} s, "
              f"finish {', '.join(r['finish_reasons'])})")
    c = report["compile_ms"]
    print(f"grammar compile: p50 {c['p50']} ms, p99 {c['p99']} ms, max {c['max']} ms over {c['count']} schemas "
          f"({c['wall_s_all']} s for all, in the engine's compile pool)")
    t = report["target"]
    print(f"target {t['name']}: {t['value_pct']}% (want {t['want']}): {'met' if t['met'] else 'NOT met'}")

"""`pagedcore bench linears`: each of the model's linear shapes at M = 1, 8, 64, 512 rows, the way the
engine runs it, against the machine's read bandwidth and matmul peak measured in the same run.

Small M is bound by reading the weight: the row reports GB/s of weight read against the bandwidth.
Large M is bound by arithmetic: TFLOP/s against the matmul peak. Each shape cycles through enough
copies of its weight (`--copies-mib`, 512: some CPUs here have hundreds of MB of L3) that every call reads it
from memory, as a decode step over 30 layers does. Shapes: the model's, and the fused q/k/v and gate/up the engine
runs in their place. Rows: `stack` (the packed kernel run as the decode stack runs it at decode: calls in one
parallel region, a barrier after each, no op dispatch or allocation: the engine's decode rows),
`packed` (pagedcore's pre-packed kernel as one op a call, as a prompt's layers run it; in the layout
the engine packs: bf16 in VNNI pairs where AMX or AVX512-BF16 runs, else 16-column panels),
`onednn` (oneDNN's pre-packed matmul, bf16: what the engine runs from onednn_linear.ROWS rows on AMX CPUs;
the targets take whichever the engine runs at each M), `F.linear`
(torch, what transformers runs; skipped where it would take minutes), `int4` (opt-in 4-bit weights, as
the engine runs them: int8 activations at decode rows), `int4-fp32` (the same weights, fp32 activations
at every M: the exact path). Rows of one shape and M alternate, `--repeats` times, best of each: on a
shared machine only an A/B within one process and interleaved in time is fair.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from pagedcore.bench.output import write_json

# Per-call budget above which F.linear is not timed (torch's bf16 matmul on CPUs without bf16 units).
SLOW_CALL_S = 0.5


@dataclass
class Row:
    shape: str
    n: int
    k: int
    m: int
    impl: str
    us: float
    gbs: float  # weight bytes read / time
    tflops: float
    bw_frac: float  # gbs / machine read bandwidth (read_gbs where probed)
    peak_frac: float  # tflops / machine matmul peak
    read_gbs: float | None = None  # the read bandwidth probed just before and after this M's rows (the larger)


def model_shapes(hf_config) -> dict[str, tuple[int, int]]:
    """name -> (out_features, in_features) of a Llama-style decoder's linears, from its config."""
    c = hf_config.get_text_config()
    heads, kv = c.num_attention_heads, getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    hd = getattr(c, "head_dim", None) or c.hidden_size // heads
    h, i = c.hidden_size, c.intermediate_size
    return {"q_proj": (heads * hd, h), "k_proj/v_proj": (kv * hd, h), "o_proj": (h, heads * hd),
            "gate_proj/up_proj": (i, h), "down_proj": (h, i), "lm_head": (c.vocab_size, h),
            # what the engine runs in their place (fused_projections.py)
            "qkv (fused)": ((heads + 2 * kv) * hd, h), "gate_up (fused)": (2 * i, h)}


def _time(fn, calls: int, seconds: float) -> float:
    """Best seconds per call over repeated passes of `calls` calls; fn(j) for a running j, so that
    passes cycle through all of a shape's weight copies rather than the first `calls`."""
    fn(0)
    best, t_end, j = math.inf, time.perf_counter() + seconds, 0
    while True:
        t0 = time.perf_counter()
        for i in range(calls):
            fn(j + i)
        j += calls
        best = min(best, (time.perf_counter() - t0) / calls)
        if time.perf_counter() >= t_end:
            return best


def _time_in_region(call, seconds: float) -> float:
    """Best of repeated `call()`s, each returning its own seconds per linear (ext.time_stack_linears)."""
    best, t_end = math.inf, time.perf_counter() + seconds
    while True:
        best = min(best, call())
        if time.perf_counter() >= t_end:
            return best


def bench_shape(name, n, k, ms, dtype, impls, bw_gbs, peak_tflops, seconds, repeats=1, copies_mib=512,
                read_probe=None) -> list[Row]:
    """Rows of one shape; with `read_probe`, each M's bandwidth fractions against the reads probed just before and
    after its rows (roofline.between_probes: this host's reads move 30 -> 57 GB/s within minutes, so one probe at
    the start once judged a 35 GB/s stream against 55)."""
    from pagedcore import huge_pages, onednn_linear, vnni_layout
    from pagedcore.kernels import cpu_ext
    from pagedcore.quantization import Int4Linear

    ext = cpu_ext.load()
    elem = torch.empty((), dtype=dtype).element_size()
    copies = max(2, math.ceil(copies_mib * 2**20 / (n * k * elem)))
    weights = [(torch.randn(n, k) * 0.02).to(dtype) for _ in range(copies)]
    runners, timers = {}, {}  # timers: impls timed by a call of their own (seconds per linear), not _time
    if ("packed" in impls or "stack" in impls) and ext is not None:
        # as the engine packs them (packed_linear.py): bf16 in VNNI pairs where AMX or AVX512-BF16 runs
        packed = [ext.pack_linear_weight_vnni(w) if vnni_layout.applies(ext, w) else ext.pack_linear_weight(w)
                  for w in weights]
        huge_pages.adopt(packed)  # where the engine keeps them (4 KiB pages read slower: roofline.read_buffer)
        if "packed" in impls:
            runners["packed"] = (lambda x, j: ext.packed_linear(x, packed[j % copies], n), n * k * elem)
        if "stack" in impls:
            runners["stack"] = (lambda x, j: ext.time_stack_linears(x, [packed[j % copies]], n, 1), n * k * elem)
            timers["stack"] = lambda x, seconds: _time_in_region(
                lambda: ext.time_stack_linears(x, packed, n, max(copies, 32)), seconds)
    if "onednn" in impls and dtype == torch.bfloat16 and onednn_linear.available():
        reordered = [torch.ops.mkldnn._reorder_linear_weight(w, 64) for w in weights]
        runners["onednn"] = (lambda x, j: onednn_linear.linear(x, reordered[j % copies], None), n * k * elem)
    if "F.linear" in impls:
        runners["F.linear"] = (lambda x, j: F.linear(x, weights[j % copies]), n * k * elem)
    int4_impls = {"int4", "int4-fp32"} & set(impls)
    if int4_impls and k % 32 == 0 and n % 16 == 0:
        int4_bytes = n * k // 2 + n * k // 32 * 2 * 2  # nibbles + fp16 scale and min per group of 32
        q = [Int4Linear(torch.nn.Linear(k, n, bias=False).requires_grad_(False), dtype)
             for _ in range(max(2, math.ceil(copies_mib * 2**20 / int4_bytes)))]
        if q[0].ext is not None:
            int4_bytes = q[0].packed.nbytes + q[0].scales_and_zeros.nbytes  # as packed (padding included)
            huge_pages.adopt([t for layer in q for t in (layer.packed, layer.scales_and_zeros)])
        if "int4" in impls:
            runners["int4"] = (lambda x, j: q[j % len(q)](x), int4_bytes)
        if "int4-fp32" in impls and q[0].ext is not None:
            runners["int4-fp32"] = (lambda x, j: ext.packed_linear_int4(
                x, q[j % len(q)].packed, q[j % len(q)].scales_and_zeros, n, 32, None, 0), int4_bytes)
    rows = []
    for m in ms:
        x = torch.randn(m, k).to(dtype)
        live = {}
        for impl, (fn, nbytes) in runners.items():
            t0 = time.perf_counter()
            fn(x, 0)
            if time.perf_counter() - t0 > SLOW_CALL_S:
                print(f"  {name} M={m} {impl}: skipped (one call took {time.perf_counter() - t0:.1f} s)", file=sys.stderr)
                continue
            live[impl] = (fn, nbytes)

        def measure() -> dict[str, float]:
            best = dict.fromkeys(live, math.inf)
            for _ in range(repeats):
                for impl, (fn, _nbytes) in live.items():
                    if impl in timers:
                        best[impl] = min(best[impl], timers[impl](x, seconds / repeats))
                    else:
                        best[impl] = min(best[impl], _time(lambda j: fn(x, j), 32, seconds / repeats))
            return best

        from pagedcore.bench.roofline import between_probes

        best, probed = between_probes(measure, read_probe)
        bw = probed or bw_gbs
        for impl, (_fn, nbytes) in live.items():
            dt = best[impl]
            gbs, tflops = nbytes / dt / 1e9, 2 * m * n * k / dt / 1e12
            rows.append(Row(name, n, k, m, impl, dt * 1e6, gbs, tflops, gbs / bw, tflops / peak_tflops, probed))
    return rows


def engine_impl(m: int, dtype: torch.dtype, onednn_rows: int | None, stack: bool = False) -> str:
    """The row the engine runs at `m` rows: oneDNN from onednn_rows rows (bf16, AMX CPUs); a decode row in the
    decode stack's region (decode_stack.py: the bundled model's family) where that row was timed; else the panels
    as one op each (a prompt's rows, layer by layer)."""
    if dtype == torch.bfloat16 and onednn_rows is not None and m >= onednn_rows:
        return "onednn"
    return "stack" if stack and m == 1 else "packed"


def targets(rows: list[Row], dtype: torch.dtype = torch.float32, onednn_rows: int | None = None) -> list[dict]:
    """Issue 13: each shape at M=1 >= 80% of the read bandwidth, at M=512 >= 85% of the matmul peak
    (what the engine runs there: the stack's region at M=1, the panels or oneDNN on AMX CPUs at 512)."""
    out, stack = [], any(r.impl == "stack" for r in rows)
    for r in rows:
        if r.m not in (1, 512) or r.impl != engine_impl(r.m, dtype, onednn_rows, stack):
            continue
        value, want = (r.bw_frac, 0.80) if r.m == 1 else (r.peak_frac, 0.85)
        what = "read bandwidth" if r.m == 1 else "matmul peak"
        out.append({"name": f"{r.shape} M={r.m} fraction of {what}", "value": round(value, 3),
                    "target": f">= {want}", "met": value >= want})
    return out


def main(args) -> int:
    from transformers import AutoConfig

    from pagedcore.bench import roofline
    from pagedcore.model_loader import resolve_model_dir

    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    dtype = getattr(torch, args.dtype)
    shapes = model_shapes(AutoConfig.from_pretrained(str(resolve_model_dir(args.model))))
    if args.shapes:
        shapes = {k: v for k, v in shapes.items() if k in args.shapes.split(",")}
    ms = [int(m) for m in args.m.split(",")]
    bw = roofline.read_bandwidth_gbs()
    peak = roofline.matmul_tflops(dtype)
    print(f"machine: read {bw:.1f} GB/s at the start (each M's rows against reads probed beside them), "
          f"matmul peak {peak * 1e3:.1f} GFLOP/s ({args.dtype} model), {torch.get_num_threads()} threads")
    rows = []
    for name, (n, k) in shapes.items():
        rows += bench_shape(name, n, k, ms, dtype, args.impls.split(","), bw, peak, args.seconds, args.repeats,
                            args.copies_mib, roofline.adjacent_read_gbs)
    print(f"{'shape':18s} {'N':>6s} {'K':>5s} {'M':>4s} {'impl':9s} {'us':>10s} {'GB/s':>7s} {'read':>6s} "
          f"{'of bw':>6s} {'GFLOP/s':>8s} {'of peak':>7s}")
    for r in rows:
        print(f"{r.shape:18s} {r.n:6d} {r.k:5d} {r.m:4d} {r.impl:9s} {r.us:10.1f} {r.gbs:7.1f} {r.read_gbs:6.1f} "
              f"{r.bw_frac:6.0%} {r.tflops * 1e3:8.1f} {r.peak_frac:7.0%}")
    from pagedcore import onednn_linear, vnni_layout
    from pagedcore.kernels import cpu_ext

    pairs = dtype == torch.bfloat16 and vnni_layout.enabled(cpu_ext.load())
    onednn_rows = onednn_linear.min_rows(pairs)  # beside the pairs oneDNN serves only prefill-sized inputs
    report = {"bench": "linears", "dtype": args.dtype, "threads": torch.get_num_threads(), "read_gbs": bw,
              "matmul_tflops": peak, "onednn_rows": onednn_rows, "vnni_pairs": pairs, "rows": [asdict(r) for r in rows],
              "targets": targets(rows, dtype, onednn_rows)}
    for t in report["targets"]:
        print(f"target {t['name']}: {t['value']} (want {t['target']}): {'met' if t['met'] else 'NOT met'}")
    write_json(report, args.json)
    return 0


def add_parser(bsub) -> None:
    p = bsub.add_parser("linears", help="each linear shape of the model at M=1..512 vs read bandwidth and matmul peak")
    p.add_argument("--model", default=None, help="HF dir or GGUF (default: the bundled SmolLM2)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--m", default="1,8,64,512", help="comma list of row counts")
    p.add_argument("--shapes", default=None, help="comma list of shape names (default: all)")
    p.add_argument("--impls", default="stack,packed,onednn,F.linear,int4",
                   help="comma list of stack, packed, onednn, F.linear, int4, int4-fp32")
    p.add_argument("--seconds", type=float, default=0.5, help="timing budget per row")
    p.add_argument("--repeats", type=int, default=1, help="alternate the rows of a shape this many times, best of each")
    p.add_argument("--copies-mib", type=float, default=512,
                   help="MiB of weight copies each shape cycles through (past the last-level cache)")
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--json", default=None)
    p.set_defaults(func=main)

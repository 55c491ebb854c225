"""Where a decode step's time goes: prepare / GEMMs / attention / other forward / sample / output processing.

`pagedcore bench step` (and `bench throughput`, in its report) fills a running batch of B sequences,
lets them reach decode, then times steps with wall-clock timers wrapped around the engine's parts
for the duration of the measurement only:
  prepare        ModelRunner.prepare + the backend's build_metadata (the step's batch tensors; StepInputs.advance
                 for a multi-step decode's further forwards)
  GEMMs          inside every nn.Linear / int4 linear of the model
  attention      inside the attention backend's forward (KV write + paged attention)
  other forward  the rest of the model forward (norms, RoPE, activations, embedding, Python)
  sample         the Sampler
  output         the rest of LLMEngine.step (bookkeeping, stop checks, detokenizing, outputs)
Every number is per forward (per token a row gains): a multi-step decode (num_scheduler_steps) runs several forwards
in one engine step, and the parts outside the forward are then shared by them.
Beside them, the floors measured in the same run: reading all weights once at the machine's read
bandwidth (bounds a batch-1 step) and the step's matmul FLOPs at the matmul peak (bounds B = 64).
CPU only: on a GPU these timers would need synchronisation.
With a captured forward (`--compile`), the linears live inside the compiled graph, where no timer
can wrap them: GEMMs are reported as "-" and "other forward" holds them (attention, an opaque op
called by the graph, is still timed). The decode stack (pagedcore/decode_stack.py: every layer in one
C++ call) times its own phases (GEMMs; attention = RoPE, cache write and paged attention; the rest),
each up to the barrier that ends it, and its row adds the LM head's GEMM; a second row times the same
batch layer by layer with the Python timers (wrapping the linears turns the stack off, as any replaced
forward does). Stack steps that run oneDNN's linears (AMX CPUs, many rows) are not split: "-" there.
"""

from __future__ import annotations

import contextlib
import math
import random
import time
from collections import defaultdict

import torch

from pagedcore import fused_projections
from pagedcore.input_batch import StepInputs

PARTS = ("prepare", "gemm", "attention", "other_forward", "sample", "output")


class StepTimers:
    def __init__(self):
        self.total = defaultdict(float)
        self.stack: dict | None = None  # the decode stack's own phase times (DecodeStack.take_profile)

    def wrap(self, key: str, fn):
        total = self.total

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                total[key] += time.perf_counter() - t0

        return timed


@contextlib.contextmanager
def instrument(engine, timers: StepTimers, per_module: bool = True):
    """Wrap the engine's parts with timers; everything is put back on exit. `per_module=False` leaves the
    model's modules and the attention backend alone (their wrappers would turn the decode stack off)."""
    runner, undo = engine.runner, []

    def set_attr(obj, name, value):
        had = name in vars(obj)
        old = vars(obj).get(name)
        setattr(obj, name, value)
        undo.append(lambda: setattr(obj, name, old) if had else delattr(obj, name))

    set_attr(runner, "prepare", timers.wrap("prepare", runner.prepare))
    set_attr(StepInputs, "advance", timers.wrap("prepare", StepInputs.advance))  # a multi-step decode's next batch
    set_attr(runner, "execute", timers.wrap("execute", runner.execute))
    backend = runner.backend
    set_attr(backend, "build_metadata", timers.wrap("prepare", backend.build_metadata))
    set_attr(engine, "sampler", timers.wrap("sample", engine.sampler))
    if per_module:
        _instrument_modules(engine, timers, set_attr)
    stack = getattr(runner, "decode_stack", None)
    if not per_module and stack is not None:
        # The stack times its own phases; the LM head after it is a module the stack does not stand in for.
        head = engine.model.get_output_embeddings()
        set_attr(head, "forward", timers.wrap("gemm", head.forward))
        if stack.greedy_head is not None:  # the LM head of argmax-only steps: a GEMM too (and the timed head is its)
            set_attr(stack.greedy_head, "forward", head.forward)
            set_attr(stack.greedy_head, "argmax", timers.wrap("gemm", stack.greedy_head.argmax))
        stack.stack.take_profile()
        stack.stack.set_profiling(True)
        undo.append(lambda: stack.stack.set_profiling(False))
    try:
        yield
    finally:
        for fn in reversed(undo):
            fn()
        if not per_module and stack is not None:
            gemm, attention, _, stack_steps = stack.stack.take_profile()
            timers.stack = {"gemm": gemm, "attention": attention, "steps": stack_steps}


def _instrument_modules(engine, timers: StepTimers, set_attr) -> None:
    backend = engine.runner.backend
    set_attr(backend, "forward", timers.wrap("attention", backend.forward))
    for module in engine.model.modules() if not captured(engine) else ():
        # (captured: the graph calls the linears' kernels itself; a wrapper would never run)
        if isinstance(module, torch.nn.Linear) or type(module).__name__ == "Int4Linear":
            set_attr(module, "forward", timers.wrap("gemm", module.forward))
    for fused in fused_projections.installed(engine.model) if not captured(engine) else ():
        set_attr(fused, "run", timers.wrap("gemm", fused.run))  # q/k/v, gate/up as one matmul at decode
        if fused.silu_mul is not None:  # gate/up with silu * up in its tiles: counted as GEMM
            set_attr(fused, "silu_mul", timers.wrap("gemm", fused.silu_mul))
        # the members' timed forwards are still the fused ones: the group keeps running fused, as unprofiled
        set_attr(fused, "forwards", tuple(m.__dict__.get("forward") for m in fused.members))


def captured(engine) -> bool:
    """Whether the engine runs its model forward through torch.compile (and has not fallen back)."""
    cap = getattr(engine.runner, "captured", None)
    return cap is not None and not cap.failed


def fill_batch(engine, batch: int, prompt_len: int, max_tokens: int, seed: int = 0) -> None:
    """Admit `batch` requests of random prompts and step until every one of them is decoding."""
    from pagedcore import SamplingParams

    rng = random.Random(seed)
    for _ in range(batch):
        prompt = [rng.randrange(100, engine.vocab_size) for _ in range(prompt_len)]
        engine.add_request(None, prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    s = engine.scheduler
    while s.waiting or s.swapped or any(q.num_output_tokens == 0 for q in s.running):
        engine.step()


def profile_decode(engine, batch: int, prompt_len: int = 128, steps: int = 10, repeats: int = 1) -> dict:
    """Mean milliseconds per decode step, split into PARTS, at a running batch of `batch` sequences. With the
    decode stack, the stack's step (forward untimed inside; the fastest of `repeats` fresh batches, as the peaks
    beside it are the best of their runs: a shared 2-core machine moves one run by a few %) and, under "layered",
    the split layer by layer."""
    if getattr(engine.runner, "decode_stack", None) is None:
        return _profile(engine, batch, prompt_len, steps, per_module=True)
    row = min((_profile(engine, batch, prompt_len, steps, per_module=False) for _ in range(max(1, repeats))),
              key=lambda r: r["step_ms"])
    row["layered"] = _profile(engine, batch, prompt_len, steps, per_module=True)
    return row


def _profile(engine, batch: int, prompt_len: int, steps: int, per_module: bool) -> dict:
    per_step = engine.config.num_scheduler_steps  # forwards an engine step may run (multi-step decode)
    fill_batch(engine, batch, prompt_len, max_tokens=steps + 2 * per_step + 8)
    engine.step()  # one untimed decode step at the full batch
    timers, t_step, compiled = StepTimers(), 0.0, captured(engine)
    opaque = compiled or not per_module
    running = list(engine.scheduler.running)
    before = sum(seq.num_output_tokens for seq in running)

    def forwards_run() -> int:  # the batch's forwards so far (tokens a row gained)
        return round((sum(seq.num_output_tokens for seq in running) - before) / len(running))

    # Engine steps until `steps` forwards ran (a multi-step decode runs several in one engine step; the contexts
    # then grow as far as with one forward a step), every number below per forward: the decode step's cost per token.
    engine_steps = 0
    with instrument(engine, timers, per_module=per_module):
        while forwards_run() < steps and engine.has_unfinished_requests():
            t0 = time.perf_counter()
            engine.step()
            t_step += time.perf_counter() - t0
            engine_steps += 1
    forwards = forwards_run()
    engine.abort_request(list(engine.requests))
    while engine.has_unfinished_requests():
        engine.step()
    t = timers.total
    # Every timed step through the stack's panel phases: its GEMM and attention phases split its forward.
    split = timers.stack is not None and timers.stack["steps"] == forwards and not compiled
    if split:
        t["gemm"] += timers.stack["gemm"]
        t["attention"] += timers.stack["attention"]
    forward = t["execute"] - t["prepare"]
    ms = {"prepare": t["prepare"], "gemm": t["gemm"], "attention": t["attention"],
          "other_forward": forward - t["gemm"] - t["attention"], "sample": t["sample"],
          "output": t_step - t["execute"] - t["sample"]}
    row = {k: round(v / forwards * 1e3, 2) for k, v in ms.items()}
    if opaque and not split:
        row["gemm"] = None  # inside the captured graph / a stack step not split: counted in other_forward
    if not per_module and not split:
        row["attention"] = None
    row.update(batch=batch, step_ms=round(t_step / forwards * 1e3, 2), compiled=compiled, decode_stack=not per_module,
               forwards=forwards, forwards_per_step=round(forwards / engine_steps, 2))
    return row


def floors(engine, batch: int, read_gbs: float, matmul_tflops: float, context: int = 0) -> dict:
    """The step's lower bounds on this machine: all weights read once; every sequence's K/V (`context`
    tokens each) read once; its matmul FLOPs at the peak."""
    from pagedcore.bench import roofline

    per_token, head = roofline.model_flops(engine.model)
    kv_bytes = batch * context * engine.runner.bytes_per_block() / engine.config.block_size
    return {"weight_read_ms": round(roofline.weight_bytes(engine.model) / read_gbs / 1e6, 2),
            "kv_read_ms": round(kv_bytes / read_gbs / 1e6, 2),
            "matmul_ms": round((per_token + head) * batch / matmul_tflops / 1e9, 2)}


def run(engine, batches=(1, 64), read_gbs: float | None = None, matmul_tflops: float | None = None,
        prompt_len: int = 128, steps: int = 10, repeats: int = 1, read_probe=None) -> list[dict]:
    """Each batch's profile with its floors. read_probe (GB/s, e.g. roofline.read_bandwidth_gbs): taken before and
    after each batch's profile, the larger its `read_gbs`, so a weight-read floor is the memory of the profile's own
    minutes (this host's read bandwidth moves 30 -> 57 GB/s within a run); else `read_gbs` (else a probe now)."""
    from pagedcore.bench import roofline

    if read_probe is None:
        read_gbs = read_gbs or roofline.read_bandwidth_gbs()
    matmul_tflops = matmul_tflops or roofline.matmul_tflops(engine.dtype)
    rows = []
    for b in batches:
        row, gbs = roofline.between_probes(lambda: profile_decode(engine, b, prompt_len, steps, repeats), read_probe)
        gbs = gbs or read_gbs
        # The timed forwards' mean context: the prompt, the first token, one untimed step, then half the timed ones.
        context = round(prompt_len + 1 + row["forwards_per_step"] + row["forwards"] / 2)
        rows.append(dict(row, read_gbs=round(gbs, 1), **floors(engine, b, gbs, matmul_tflops, context)))
    return rows


def run_int4_activations(engine, modes: list[str], repeats: int, batches=(1,), prompt_len: int = 128,
                         steps: int = 10) -> dict[str, list[dict]]:
    """The same int4 engine with each activation mode of its decode rows (quantization.int8_activation_rows),
    the modes alternating `repeats` times, best step of each per batch: an A/B in one process."""
    from pagedcore import quantization

    saved, best = quantization.INT8_ACTIVATION_ROWS, {}
    try:
        for _ in range(repeats):
            for mode in modes:
                quantization.INT8_ACTIVATION_ROWS = quantization.int8_activation_rows(mode)
                # No floors: roofline's FLOP and byte counts read nn.Linear weights, which int4 layers lack.
                rows = [dict(profile_decode(engine, b, prompt_len, steps), weight_read_ms=math.nan, matmul_ms=math.nan)
                        for b in batches]
                best[mode] = [min(old, new, key=lambda r: r["step_ms"]) for old, new in zip(best.get(mode, rows), rows)]
    finally:
        quantization.INT8_ACTIVATION_ROWS = saved
    return best


def with_layered(rows: list[dict]) -> list[dict]:
    """Each row followed by its layer-by-layer split, if it has one (floors copied), labelled by `path`."""
    out = []
    for r in rows:
        out.append(dict(r, path="decode stack" if r.get("decode_stack") else "layer by layer"))
        if r.get("layered"):
            out.append(dict(r["layered"], path="layer by layer", weight_read_ms=r.get("weight_read_ms"),
                            kv_read_ms=r.get("kv_read_ms"), matmul_ms=r.get("matmul_ms"), read_gbs=r.get("read_gbs")))
    return out


def run_stack_ab(engine, repeats: int, batches=(1,), prompt_len: int = 128, steps: int = 10) -> dict[str, list[dict]]:
    """The same engine's decode steps with the decode stack and layer by layer, alternating `repeats` times, no
    timers inside the forward either way (best step of each per batch): an A/B in one process."""
    stack, best = engine.runner.decode_stack, {}
    if stack is None:
        raise SystemExit("--stack-ab: this engine has no decode stack (see the log for why)")
    try:
        for _ in range(repeats):
            for name, value in (("decode stack", stack), ("layer by layer", None)):
                engine.runner.decode_stack = value
                rows = [dict(_profile(engine, b, prompt_len, steps, per_module=False), decode_stack=value is not None,
                             weight_read_ms=math.nan, matmul_ms=math.nan) for b in batches]
                best[name] = [min(old, new, key=lambda r: r["step_ms"]) for old, new in zip(best.get(name, rows), rows)]
    finally:
        engine.runner.decode_stack = stack
    return best


def format_rows(rows: list[dict]) -> list[str]:
    head = f"{'batch':>5s} {'path':>14s} {'step ms':>8s} " + " ".join(f"{p:>13s}" for p in PARTS) \
        + f" {'weights ms':>10s} {'K/V ms':>7s} {'matmul ms':>9s} {'read GB/s':>9s}"
    lines = [head]
    for r in with_layered(rows):
        lines.append(f"{r['batch']:5d} {r['path']:>14s} {r['step_ms']:8.2f} "
                     + " ".join(f"{r[p]:13.2f}" if r[p] is not None else f"{'-':>13s}" for p in PARTS)
                     + f" {r['weight_read_ms']:10.2f} {r.get('kv_read_ms', math.nan):7.2f} {r['matmul_ms']:9.2f}"
                     + f" {r.get('read_gbs') or math.nan:9.1f}")
    return lines


def main(args) -> int:
    import json
    import sys

    from pagedcore import LLMEngine

    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    settings = dict(model=args.model, dtype=args.dtype, max_num_seqs=max(args.batches))
    if args.no_pack:
        settings["pack_weights"] = False
    if args.quantization:
        settings["quantization"] = args.quantization
    if args.compile:
        settings["compile"] = True
    engine = LLMEngine(**settings)
    modes = args.int4_activations.split(",") if args.int4_activations else []
    if modes:
        if args.quantization != "int4":
            raise SystemExit("--int4-activations needs --quantization int4")
        by_mode = run_int4_activations(engine, modes, args.repeats, args.batches, args.prompt_len, args.steps)
        for mode, rows in by_mode.items():
            print(f"int4 weights, {mode} activations at decode rows: best of {args.repeats} (ms per step)")
            print("\n".join(format_rows(rows)))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"bench": "step", "dtype": args.dtype, "settings": settings, "by_int4_activations": by_mode},
                          f, indent=2)
        return 0
    if args.stack_ab:
        by_path = run_stack_ab(engine, args.stack_ab, args.batches, args.prompt_len, args.steps)
        for path, rows in by_path.items():
            print(f"{path}: best of {args.stack_ab} (ms per step)")
            print("\n".join(format_rows(rows)))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"bench": "step", "dtype": args.dtype, "settings": settings, "stack_ab": by_path}, f, indent=2)
        return 0
    from pagedcore.bench import roofline

    rows = run(engine, args.batches, prompt_len=args.prompt_len, steps=args.steps, read_probe=roofline.adjacent_read_gbs)
    mode = "captured forward (torch.compile)" if rows and rows[0]["compiled"] else "eager forward"
    print(f"decode step profile, {args.dtype}, {torch.get_num_threads()} threads, {mode} (ms per step)")
    print("\n".join(format_rows(rows)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bench": "step", "dtype": args.dtype, "settings": settings, "rows": rows}, f, indent=2)
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


def add_parser(bsub) -> None:
    p = bsub.add_parser("step", help="decode step time split into prepare / GEMMs / attention / other / sample / output")
    p.add_argument("--model", default=None, help="HF dir or GGUF (default: the bundled SmolLM2)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 64])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--no-pack", action="store_true", help="F.linear over unpacked weights (for before/after)")
    p.add_argument("--quantization", default=None, choices=["int4"])
    p.add_argument("--int4-activations", default=None,
                   help="comma list of int8, fp32: with --quantization int4, A/B of the decode rows' activations")
    p.add_argument("--repeats", type=int, default=3, help="with --int4-activations: alternations, best of each")
    p.add_argument("--compile", action="store_true", help="capture the model forward with torch.compile")
    p.add_argument("--stack-ab", type=int, default=0, metavar="REPEATS",
                   help="A/B of the decode stack against layer by layer, alternating REPEATS times, best of each")
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--json", default=None)
    p.set_defaults(func=main)

"""`pagedcore bench memory`: what paging buys in memory, measured on the engine itself.

- waste: KV slots allocated but empty, after every step of the offline throughput workload;
- concurrency: how many sequences a KV budget holds, paged vs a contiguous max_model_len reservation
  per sequence (HF static caches, naive engines), computed from the workload and observed by running it
  in an engine whose whole KV cache is that budget;
- sharing: one n=4 request vs the same prompt sent as 4 independent requests, peak blocks in use;
- weights (`--weights MODEL[@QUANTIZATION[:GROUP]]`, repeatable, instead of the above; weights.py): the bytes an
  engine holds for its weights, per format (bf16, int4, GPTQ / AWQ / compressed-tensors dirs, GGUF native).
- KV capacity per `kv_cache_dtype` (kv_capacity.py).
"""

from __future__ import annotations

import itertools
import random
from dataclasses import asdict, dataclass
from datetime import datetime, timezone

from pagedcore.bench.kv_capacity import capacity_rows, check_pool_whole, kv_capacity, make_engine
from pagedcore.bench.output import write_json
from pagedcore.bench.weights import MIB, print_weights, run_weights
from pagedcore.bench.workload import add_workload_args, workload_from_args
from pagedcore.kv_cache_manager import cdiv



@dataclass
class KVSnapshot:
    blocks_used: int  # distinct device blocks held by running sequences
    tokens_stored: int  # KV entries written in those blocks
    num_running: int
    pool_blocks_used: int  # the pool's own count (ref count > 0), for the cross-check


def kv_snapshot(engine) -> KVSnapshot:
    """The engine's device KV cache between two steps, counted per physical block.

    Honest accounting, in four choices:
    - A block shared by forks or by a prefix-cache hit is one block holding its tokens once, so
      blocks and tokens are gathered by physical block id, not summed over block tables (which
      would count a shared prompt n times on both sides and hide the sharing).
    - Tokens stored are `num_computed_tokens`: the KV actually written. The token sampled last step
      has no KV yet; it is written (in an already allocated slot or a new block) next step.
    - Free blocks that still hold a cached prefix have ref count 0: the pool hands them out on
      demand, so they are free memory, not used memory, and are not counted.
    - Swapped-out sequences hold CPU blocks, not device ones; waiting sequences hold none.
    `pool_blocks_used` (blocks with ref count > 0) must equal `blocks_used`: the check that no block
    is held outside a running sequence's table.
    """
    bs = engine.config.block_size
    running = engine.scheduler.running
    pool_used = engine.kv.num_blocks - engine.kv.num_free_blocks
    tables = [seq.block_table for seq in running]
    held = sum(map(len, tables))
    if len(set(itertools.chain.from_iterable(tables))) == held:
        # No block shared (the usual step): per sequence, its first num_computed_tokens slots are filled. The
        # throughput bench takes this snapshot after every timed step: ~4x cheaper than the per-block walk.
        tokens = sum(min(seq.num_computed_tokens, len(seq.block_table) * bs) for seq in running)
        return KVSnapshot(held, tokens, len(running), pool_used)
    return KVSnapshot(*blocks_and_tokens(running, bs), len(running), pool_used)


def blocks_and_tokens(running, block_size: int) -> tuple[int, int]:
    """Distinct physical blocks of the running sequences and the tokens they hold, block by block (shared ones once)."""
    filled: dict[int, int] = {}
    for seq in running:
        for i, block in enumerate(seq.block_table):
            n = min(max(seq.num_computed_tokens - i * block_size, 0), block_size)
            filled[block] = max(filled.get(block, 0), n)
    return len(filled), sum(filled.values())


@dataclass
class WasteTrace:
    """Snapshots summed over a run's steps."""
    block_size: int
    max_model_len: int  # for the contiguous reservation over the same steps
    steps: int = 0
    slots: int = 0  # sum of blocks_used * block_size
    tokens: int = 0  # sum of tokens_stored
    reserved: int = 0  # sum of num_running * max_model_len
    max_pct: float = 0.0
    peak_running: int = 0
    running_sum: int = 0
    unaccounted_blocks: int = 0  # max over steps of pool_blocks_used - blocks_used

    def add(self, snap: KVSnapshot) -> None:
        if snap.blocks_used == 0:  # nothing held: no waste to speak of
            return
        slots = snap.blocks_used * self.block_size
        self.steps += 1
        self.slots += slots
        self.tokens += snap.tokens_stored
        self.reserved += snap.num_running * self.max_model_len
        self.max_pct = max(self.max_pct, 100.0 * (1 - snap.tokens_stored / slots))
        self.peak_running = max(self.peak_running, snap.num_running)
        self.running_sum += snap.num_running
        self.unaccounted_blocks = max(self.unaccounted_blocks, snap.pool_blocks_used - snap.blocks_used)

    @property
    def mean_pct(self) -> float:
        """Steps weighted by what they hold: the share of all slot-steps that held no token."""
        return 100.0 * (1 - self.tokens / self.slots) if self.slots else 0.0

    @property
    def contiguous_pct(self) -> float:
        return 100.0 * (1 - self.tokens / self.reserved) if self.reserved else 0.0

    @property
    def mean_running(self) -> float:
        return self.running_sum / self.steps if self.steps else 0.0


def step_all(engine, on_step) -> None:
    while engine.has_unfinished_requests():
        engine.step()
        on_step(kv_snapshot(engine))
    check_pool_whole(engine)


def run_workload(engine, prompts: list[list[int]], out_lens: list[int], max_model_len: int) -> WasteTrace:
    """Exact output lengths (greedy, EOS ignored), every request queued at once, as in bench throughput."""
    from pagedcore import SamplingParams

    for i, (p, n) in enumerate(zip(prompts, out_lens)):
        engine.add_request(f"w{i}", p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    trace = WasteTrace(engine.config.block_size, max_model_len)
    step_all(engine, trace.add)
    return trace


@dataclass
class Concurrency:
    kv_budget_mib: float
    bytes_per_block: int
    budget_blocks: int
    max_model_len: int
    paged_computed: int  # sequences of the workload's mean footprint that fit, each at its final length
    paged_observed: int  # peak running sequences when the engine's whole KV cache is the budget
    paged_observed_mean: float  # mean running sequences over that run's steps
    contiguous: int  # sequences that fit when each reserves max_model_len tokens
    preemptions: int


def concurrency(budget_bytes: int, bytes_per_block: int, block_size: int, max_model_len: int,
                seq_lens: list[int], trace: WasteTrace, preemptions: int) -> Concurrency:
    budget_blocks = budget_bytes // bytes_per_block
    footprint = sum(cdiv(n, block_size) for n in seq_lens)  # blocks of all sequences at their final length
    # Contiguous: the same bytes per token, but every sequence reserves max_model_len of them.
    contiguous = budget_bytes * block_size // (max_model_len * bytes_per_block)
    return Concurrency(round(budget_bytes / MIB, 3), bytes_per_block, budget_blocks, max_model_len,
                       budget_blocks * len(seq_lens) // footprint, trace.peak_running,
                       round(trace.mean_running, 2), contiguous, preemptions)


@dataclass
class Sharing:
    n: int
    prompt_tokens: int
    output_tokens: int
    blocks_shared: int  # peak blocks in use, one request with n samples
    blocks_independent: int  # peak blocks in use, the same prompt as n requests

    @property
    def saving_pct(self) -> float:
        return 100.0 * (1 - self.blocks_shared / self.blocks_independent)


def peak_blocks(engine, submit) -> int:
    peak = 0

    def on_step(snap: KVSnapshot) -> None:
        nonlocal peak
        peak = max(peak, snap.blocks_used)

    submit(engine)
    step_all(engine, on_step)
    return peak


def sharing(engine, prompt: list[int], n: int, output_tokens: int, seed: int) -> Sharing:
    """Peak blocks in use, reached once the prompt is computed: the n samples fork its blocks (ref
    counts; only the partly filled last block is copied, on write), n requests each hold a copy.
    Needs an engine without prefix caching (otherwise the independent requests would share too) and
    with blocks to spare (a preemption would lower a peak)."""
    from pagedcore import SamplingParams

    assert not engine.config.enable_prefix_caching
    shared = peak_blocks(engine, lambda e: e.add_request("n", prompt, SamplingParams(
        n=n, temperature=0.8, seed=seed, max_tokens=output_tokens, ignore_eos=True)))
    independent = peak_blocks(engine, lambda e: [e.add_request(f"i{i}", prompt, SamplingParams(
        temperature=0.8, seed=seed + i, max_tokens=output_tokens, ignore_eos=True)) for i in range(n)])
    if engine.scheduler.num_preemptions:
        raise RuntimeError("the sharing engine preempted: its peaks are not comparable")
    return Sharing(n, len(prompt), output_tokens, shared, independent)


def run(args) -> dict:
    """All four measurements; returns the JSON report."""
    from pagedcore.model_loader import resolve_model_dir

    model_dir = str(resolve_model_dir(args.model))
    bs = args.block_size
    # Sharing first: its engine also tells the bytes per block the budget engine is sized with.
    share_blocks = args.n * (cdiv(args.share_prompt_tokens + args.share_output_tokens, bs) + 1) + 8
    engine = make_engine(model_dir, args, enable_prefix_caching=False, num_kv_blocks=share_blocks, num_cpu_blocks=0)
    rng = random.Random(args.seed)
    share_prompt = [rng.randrange(100, engine.vocab_size) for _ in range(args.share_prompt_tokens)]
    shared = sharing(engine, share_prompt, args.n, args.share_output_tokens, args.seed)
    bytes_per_block, vocab = engine.runner.bytes_per_block(), engine.vocab_size
    del engine

    budget_bytes = int(args.kv_budget_mib * MIB)
    budget_blocks = budget_bytes // bytes_per_block
    wl = workload_from_args(args)
    prompts, out_lens = wl.make(vocab)
    seq_lens = [len(p) + n for p, n in zip(prompts, out_lens)]
    if max(seq_lens) > budget_blocks * bs:
        raise ValueError(f"--kv-budget-mib {args.kv_budget_mib} holds {budget_blocks} blocks = {budget_blocks * bs} "
                         f"tokens, less than the longest sequence ({max(seq_lens)} tokens)")
    # The budget engine: prefix caching on (the default, as bench throughput runs), max_num_seqs high
    # so that only KV blocks limit how many sequences run.
    engine = make_engine(model_dir, args, num_kv_blocks=budget_blocks, max_num_seqs=args.max_num_seqs)
    assert engine.runner.bytes_per_block() == bytes_per_block
    trace = run_workload(engine, prompts, out_lens, args.max_model_len)
    if trace.unaccounted_blocks:
        raise RuntimeError(f"{trace.unaccounted_blocks} blocks held outside running sequences' block tables")
    conc = concurrency(budget_bytes, bytes_per_block, bs, args.max_model_len, seq_lens, trace,
                       engine.scheduler.num_preemptions)
    del engine
    capacity = kv_capacity(model_dir, args, budget_bytes) if args.kv_cache_dtypes else []
    return {
        "bench": "memory", "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "model": args.model or "SmolLM2-135M-Instruct (bundled)", "dtype": args.dtype, "block_size": bs,
        "workload": asdict(wl),
        "waste": {"mean_pct": round(trace.mean_pct, 3), "max_pct": round(trace.max_pct, 3), "steps": trace.steps,
                  "contiguous_pct": round(trace.contiguous_pct, 3)},
        "concurrency": asdict(conc),
        "sharing": dict(asdict(shared), saving_pct=round(shared.saving_pct, 2)),
        "kv_capacity": [asdict(c) for c in capacity],
    }


def table_rows(report: dict) -> list[tuple[str, str]]:
    """(measurement, value) rows, each self-describing: the printed table and the report's memory table."""
    w, c, s = report["waste"], report["concurrency"], report["sharing"]
    budget = f"sequences in {c['kv_budget_mib']:g} MiB of KV ({c['budget_blocks']} blocks of " \
             f"{c['bytes_per_block'] / 1024:g} KiB)"
    share = f"n={s['n']} on a {s['prompt_tokens']}-token prompt, peak blocks"
    observed = f"{c['paged_observed']} / {c['paged_observed_mean']:g}"
    if c.get("preemptions"):
        observed += f" ({c['preemptions']} preemptions)"
    rows = [(f"KV waste, paged, block size {report['block_size']} (mean / max over {w['steps']} steps)",
             f"{w['mean_pct']:.2f} % / {w['max_pct']:.2f} %")]
    if "contiguous_pct" in w:
        rows.append((f"KV waste, contiguous {c['max_model_len']}-token reservation (same steps)",
                     f"{w['contiguous_pct']:.2f} %"))
    return rows + [
        (f"{budget}: paged, computed at full length", str(c["paged_computed"])),
        (f"{budget}: paged, observed running (peak / mean)", observed),
        (f"{budget}: contiguous {c['max_model_len']}-token reservation", str(c["contiguous"])),
        (f"{share}: one request (samples fork the prompt)", str(s["blocks_shared"])),
        (f"{share}: {s['n']} independent requests", str(s["blocks_independent"])),
        (f"{share}: saving", f"{s['saving_pct']:.1f} %"),
    ] + capacity_rows(report)


def print_report(report: dict) -> None:
    w = report["workload"]
    print(f"\n{report['model']}, {report['dtype']}; workload: {w['num_prompts']} prompts, input {w['input_len']}, "
          f"output {w['output_len']} tokens, seed {w['seed']}")
    rows = table_rows(report)
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:{width}s}  {v}")


def main(args) -> int:
    import torch

    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    if args.weights:
        report = run_weights(args)
        print_weights(report)
    else:
        report = run(args)  # a ValueError (budget too small) becomes `error: ...` in the CLI
        print_report(report)
    write_json(report, args.json)
    return 0


def add_parser(bsub) -> None:
    m = bsub.add_parser("memory", help="KV waste, concurrent sequences per KV budget, n-sample sharing")
    m.add_argument("--model", default=None, help="HF dir or GGUF (default: the bundled SmolLM2)")
    m.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    m.add_argument("--num-threads", type=int, default=None, help="torch threads (default: torch's)")
    m.add_argument("--block-size", type=int, default=16)
    add_workload_args(m)
    m.add_argument("--kv-budget-mib", type=float, default=256.0, help="KV budget for the concurrency comparison")
    m.add_argument("--max-model-len", type=int, default=2048, help="what a contiguous cache reserves per sequence")
    m.add_argument("--max-num-seqs", type=int, default=1024, help="high, so that KV blocks are the limit")
    m.add_argument("-n", type=int, default=4, help="samples of the sharing request")
    m.add_argument("--share-prompt-tokens", type=int, default=600)
    m.add_argument("--share-output-tokens", type=int, default=16)
    m.add_argument("--weights", action="append", default=[], metavar="MODEL[@QUANTIZATION[:GROUP]]",
                   help="instead of the KV measurements: resident weight bytes of an engine on MODEL ('bundled', an "
                        "HF dir, a GGUF), with quantization int4 (':64' for groups of 64) or gguf after '@'; repeat to compare formats")
    m.add_argument("--stream-tokens", type=int, default=64,
                   help="with --weights: tokens of one greedy stream timed per source (TPOT, tok/s); 0 skips it")
    m.add_argument("--kv-cache-dtypes", default="auto,int8,fp8_e4m3",
                   help="KV capacity per kv_cache_dtype, the first the reference ('' skips the table)")
    m.add_argument("--capacity-seq-len", type=int, default=1024, help="sequence length of the capacity table")
    m.add_argument("--agreement-tokens", type=int, default=32,
                   help="greedy tokens per prompt for the agreement with the first kv_cache_dtype (0: skip)")
    m.add_argument("--json", default=None, help="write results here")
    m.set_defaults(func=main)

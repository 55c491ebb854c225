"""`pagedcore bench throughput`: offline throughput of the engine against peers measured in the same run."""

from __future__ import annotations

import json
import platform
import random
import time
from dataclasses import asdict, dataclass


@dataclass
class Workload:
    num_prompts: int = 64
    input_len: tuple[int, int] = (32, 256)
    output_len: tuple[int, int] = (16, 128)
    seed: int = 0

    def make(self, vocab_size: int) -> tuple[list[list[int]], list[int]]:
        """Random token-id prompts and exact output lengths (EOS ignored), seeded."""
        rng = random.Random(self.seed)
        prompts = [[rng.randrange(100, vocab_size) for _ in range(rng.randint(*self.input_len))]
                   for _ in range(self.num_prompts)]
        outputs = [rng.randint(*self.output_len) for _ in range(self.num_prompts)]
        return prompts, outputs


@dataclass
class Result:
    engine: str
    seconds: float
    num_requests: int
    input_tokens: int
    output_tokens: int

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.seconds

    def row(self) -> dict:
        d = asdict(self)
        d.update(output_tok_s=round(self.output_tok_s, 2),
                 total_tok_s=round((self.input_tokens + self.output_tokens) / self.seconds, 2),
                 requests_s=round(self.num_requests / self.seconds, 3))
        return d


def run_pagedcore(prompts, out_lens, settings: dict) -> Result:
    from pagedcore import LLM, SamplingParams

    llm = LLM(**settings)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in out_lens]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    return Result("pagedcore", dt, len(prompts), sum(map(len, prompts)), n_out)


def run_hf_loop(prompts, out_lens, model_dir: str, dtype) -> Result:
    """transformers generate(), one request at a time (what a plain HF user writes)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    gen = dict(do_sample=False, pad_token_id=model.config.eos_token_id)
    with torch.inference_mode():
        model.generate(torch.tensor([prompts[0]]), max_new_tokens=2, min_new_tokens=2, **gen)  # warm-up
        t0 = time.perf_counter()
        n_out = 0
        for p, n in zip(prompts, out_lens):
            out = model.generate(torch.tensor([p]), max_new_tokens=n, min_new_tokens=n, **gen)
            n_out += out.shape[1] - len(p)
        dt = time.perf_counter() - t0
    return Result("transformers generate() one by one", dt, len(prompts), sum(map(len, prompts)), n_out)


def throughput(args) -> int:
    import torch

    from pagedcore.model_loader import resolve_model_dir

    model_dir = str(resolve_model_dir(args.model))
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    wl = Workload(args.num_prompts, (args.input_min, args.input_max), (args.output_min, args.output_max), args.seed)
    prompts, out_lens = wl.make(vocab)
    results = [run_pagedcore(prompts, out_lens, dict(model=model_dir, dtype=args.dtype,
                                                     max_num_seqs=args.max_num_seqs))]
    peers = set(args.peers.split(",")) if args.peers else set()
    if "hf-loop" in peers or "all" in peers:
        results.append(run_hf_loop(prompts, out_lens, model_dir, dtype))
    base = results[0]
    print(f"\nworkload: {asdict(wl)}, dtype {args.dtype}, torch threads {torch.get_num_threads()}")
    print(f"{'engine':40s} {'out tok/s':>10s} {'total tok/s':>12s} {'req/s':>8s} {'pagedcore x':>12s}")
    for r in results:
        row = r.row()
        print(f"{r.engine:40s} {row['output_tok_s']:10.1f} {row['total_tok_s']:12.1f} {row['requests_s']:8.2f} "
              f"{base.output_tok_s / r.output_tok_s:12.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"workload": asdict(wl), "dtype": args.dtype, "machine": platform.machine(),
                       "torch_threads": torch.get_num_threads(), "results": [r.row() for r in results]}, f, indent=2)
    return 0


def prefix(args) -> int:
    """Time to first token with a shared system prompt: prefix cache off vs on (warm)."""
    import statistics

    from pagedcore import LLM, SamplingParams
    from pagedcore.model_loader import resolve_model_dir

    model_dir = str(resolve_model_dir(args.model))
    params = SamplingParams(temperature=0, max_tokens=1)
    rows = {}
    for caching in (False, True):
        llm = LLM(model_dir, dtype=args.dtype, enable_prefix_caching=caching, num_kv_blocks=args.num_kv_blocks)
        tok = llm.get_tokenizer()
        system = " ".join(["The assistant answers briefly and precisely."] * (args.system_tokens // 7))
        base = tok.encode(system)[:args.system_tokens]

        def prompt(i):
            return base + tok.encode(f" Question {i}: what is {i} plus {i}?")

        llm.generate([prompt(-1)], params, use_tqdm=False)  # warm-up (fills the cache when on)
        ttft = []
        for i in range(args.num_requests):  # one at a time: TTFT without queueing
            out = llm.generate([prompt(i)], params, use_tqdm=False)[0]
            ttft.append(out.metrics.time_to_first_token)
        rows["on" if caching else "off"] = statistics.median(ttft)
    speedup = rows["off"] / rows["on"]
    print(f"shared system prompt {args.system_tokens} tokens, {args.num_requests} requests, dtype {args.dtype}")
    print(f"median TTFT: prefix cache off {rows['off'] * 1e3:.1f} ms, on (warm) {rows['on'] * 1e3:.1f} ms, "
          f"speed-up {speedup:.1f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"system_tokens": args.system_tokens, "ttft_off_s": rows["off"], "ttft_on_s": rows["on"],
                       "speedup": speedup, "dtype": args.dtype}, f, indent=2)
    return 0


def add_parser(sub) -> None:
    b = sub.add_parser("bench", help="benchmarks against peers measured in the same run")
    bsub = b.add_subparsers(dest="bench_command", required=True)
    t = bsub.add_parser("throughput", help="offline throughput on random token-id prompts")
    t.add_argument("--model", default=None)
    t.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    t.add_argument("--num-prompts", type=int, default=64)
    t.add_argument("--input-min", type=int, default=32)
    t.add_argument("--input-max", type=int, default=256)
    t.add_argument("--output-min", type=int, default=16)
    t.add_argument("--output-max", type=int, default=128)
    t.add_argument("--max-num-seqs", type=int, default=128)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--peers", default="", help="comma list: hf-loop, all")
    t.add_argument("--json", default=None, help="write results here")
    t.set_defaults(func=throughput)
    p = bsub.add_parser("prefix", help="TTFT with a shared system prompt, prefix cache off vs on")
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--system-tokens", type=int, default=1000)
    p.add_argument("--num-requests", type=int, default=8)
    p.add_argument("--num-kv-blocks", type=int, default=512)
    p.add_argument("--json", default=None)
    p.set_defaults(func=prefix)

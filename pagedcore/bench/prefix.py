"""`pagedcore bench prefix`: time to first token with a shared system prompt, prefix cache off vs on."""

from __future__ import annotations

import json


def main(args) -> int:
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


def add_parser(bsub) -> None:
    p = bsub.add_parser("prefix", help="TTFT with a shared system prompt, prefix cache off vs on")
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--system-tokens", type=int, default=1000)
    p.add_argument("--num-requests", type=int, default=8)
    p.add_argument("--num-kv-blocks", type=int, default=512)
    p.add_argument("--json", default=None)
    p.set_defaults(func=main)

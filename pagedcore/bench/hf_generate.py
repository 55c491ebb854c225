"""`python -m pagedcore.bench.hf_generate`: one `model.generate()` call, transformers' own vs patched by pagedcore.

Workload (seeded): `--num-prompts` chat prompts drawn from templates whose natural answers differ in
length (a one-word rhyme, a capital city, a list, a poem, a detailed explanation), chat-templated and
left-padded into ONE batch, greedy, `--max-new-tokens` as the cap. Rows hit EOS at different steps:
transformers keeps stepping every row (finished ones on padding) until the longest is done, while
pagedcore makes each row its own request and drops it when it ends. Both calls are the same
`model.generate(input_ids, attention_mask=..., max_new_tokens=..., do_sample=False)` on the same model
object; the first patched call (engine creation, KV cache allocation) is timed apart as setup.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time

TEMPLATES = [
    "Give me one word that rhymes with {}.",
    "What is the capital of {}? Answer in one short sentence.",
    "List three facts about {}.",
    "Write a short poem about {}.",
    "Explain in detail how {} works, step by step, for a curious ten-year-old.",
    "Say hello in {} and nothing else.",
]
SUBJECTS = [
    ["cat", "light", "tree", "moon", "house", "river"],
    ["France", "Japan", "Kenya", "Peru", "Canada", "Norway"],
    ["the sun", "honey bees", "volcanoes", "the Roman Empire", "octopuses", "glaciers"],
    ["the sea", "autumn", "a lighthouse", "rain", "the city at night", "friendship"],
    ["a bicycle", "a refrigerator", "the internet", "a rainbow", "a vaccine", "an airplane"],
    ["Spanish", "German", "Italian", "Swahili", "Portuguese", "Dutch"],
]


def make_prompts(num_prompts: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    prompts = []
    for i in range(num_prompts):
        t = i % len(TEMPLATES) if i < len(TEMPLATES) else rng.randrange(len(TEMPLATES))
        prompts.append(TEMPLATES[t].format(rng.choice(SUBJECTS[t])))
    return prompts


def useful_lengths(sequences, width: int, eos: set[int]) -> list[int]:
    """Generated tokens per row up to and including its first EOS (what the user keeps)."""
    lengths = []
    for row in sequences[:, width:].tolist():
        n = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        lengths.append(n)
    return lengths


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF directory or .gguf (default: the bundled SmolLM2)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None, help="torch threads for both runs")
    ap.add_argument("--num-kv-blocks", type=int, default=None, help="engine KV blocks (default: engine's budget)")
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--json", default="benchmark_hf.json", help="write results here ('' to skip)")
    args = ap.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagedcore.adapters.hf import patched
    from pagedcore.model_loader import resolve_model_dir

    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = str(resolve_model_dir(args.model))
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    texts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
             for p in make_prompts(args.num_prompts, args.seed)]
    batch = tok(texts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    width = batch["input_ids"].shape[1]
    pad = tok.pad_token_id if tok.pad_token_id is not None else model.generation_config.eos_token_id
    kw = dict(max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=pad)
    warm = {k: v[:2] for k, v in batch.items()}

    def generate(**extra):
        return model.generate(**batch, **kw, **extra)

    with torch.inference_mode():
        model.generate(**warm, max_new_tokens=2, do_sample=False, pad_token_id=pad)
    original, t_original = timed(generate)

    settings = {"max_num_seqs": args.max_num_seqs}
    if args.num_kv_blocks:
        settings["num_kv_blocks"] = args.num_kv_blocks
    with patched(model, **settings):
        _, t_setup = timed(lambda: model.generate(**warm, max_new_tokens=2, do_sample=False, pad_token_id=pad))
        ours, t_patched = timed(generate)

    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    lengths = useful_lengths(original, width, eos)
    same_shape = ours.shape == original.shape
    differing = sum(not torch.equal(a, b) for a, b in zip(ours, original)) if same_shape else len(lengths)
    result = {
        "workload": {"num_prompts": args.num_prompts, "max_new_tokens": args.max_new_tokens, "seed": args.seed,
                     "model": model_dir, "dtype": args.dtype, "padded_prompt_len": width,
                     "description": "one left-padded greedy batch of chat prompts whose rows hit EOS at "
                                    "different steps"},
        "generated_tokens": {"total": sum(lengths), "min": min(lengths), "median": statistics.median(lengths),
                             "max": max(lengths),
                             "row_steps_transformers": len(lengths) * (original.shape[1] - width)},
        "original": {"seconds": t_original, "useful_tok_s": round(sum(lengths) / t_original, 2)},
        "patched": {"seconds": t_patched, "useful_tok_s": round(sum(lengths) / t_patched, 2),
                    "engine_setup_seconds": round(t_setup, 4)},
        "speedup": t_original / t_patched,
        "outputs_equal": bool(same_shape and torch.equal(ours, original)),
        "rows_differing": differing,
        "torch_threads": torch.get_num_threads(),
        "machine": platform.machine(),
    }
    g = result["generated_tokens"]
    print(f"workload: {args.num_prompts} chat prompts in one left-padded batch (width {width}), greedy, "
          f"max_new_tokens {args.max_new_tokens}; generated per row min {g['min']} / median {g['median']} / "
          f"max {g['max']}, {g['total']} useful tokens; {args.dtype}, torch threads {torch.get_num_threads()}")
    print(f"{'generate()':28s} {'seconds':>9s} {'useful tok/s':>13s}")
    print(f"{'transformers (original)':28s} {t_original:9.2f} {result['original']['useful_tok_s']:13.1f}")
    print(f"{'pagedcore (patched)':28s} {t_patched:9.2f} {result['patched']['useful_tok_s']:13.1f}")
    print(f"speedup x{result['speedup']:.2f} (engine setup {t_setup:.2f} s, not included); outputs equal: "
          f"{result['outputs_equal']} ({differing} rows differ)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`pagedcore bench memory`'s KV capacity per `kv_cache_dtype` (model dtype, int8, fp8 e4m3): bytes per block
(values and scales), blocks and sequences of a given length in the budget, and greedy agreement with the
model-dtype cache on a few chat prompts."""

from __future__ import annotations

from dataclasses import dataclass

from pagedcore.kv_cache_manager import cdiv


def make_engine(model_dir: str, args, **settings):
    """An engine as `bench memory`'s flags ask for (dtype, block size, threads)."""
    from pagedcore import LLMEngine

    return LLMEngine(model=model_dir, dtype=args.dtype, block_size=args.block_size, num_threads=args.num_threads,
                     **settings)


def check_pool_whole(engine) -> None:
    """Every block back in the free queue (cached ones included: free, just still reusable)."""
    kv = engine.kv
    if kv.num_free_blocks != kv.num_blocks:
        raise RuntimeError(f"KV blocks leaked: {kv.num_blocks - kv.num_free_blocks} of {kv.num_blocks} still held")
    if kv.cpu_pool is not None and kv.cpu_pool.num_free_blocks != kv.cpu_pool.num_blocks:
        raise RuntimeError("CPU swap blocks leaked")


# The greedy-agreement prompt set of the KV capacity table (chat template applied).
AGREEMENT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List three prime numbers.",
    "Translate 'good morning' into Spanish and German, and say which languages these are.",
    "What does a compiler do? Answer for a ten-year-old, in detail, with an example about cooking recipes.",
    "Name a famous painting.",
    "Give me a recipe for pancakes.",
]


@dataclass
class KVCapacity:
    kv_cache_dtype: str
    bytes_per_block: int  # K and V of every layer; a quantized block counts its scales
    budget_blocks: int
    seq_len: int
    max_seqs: int  # sequences of seq_len tokens the budget holds
    vs_model_dtype: float  # budget_blocks / the model-dtype cache's
    agreement: float | None = None  # greedy tokens before the first divergence from the model-dtype cache / all
    identical_prompts: int | None = None  # prompts whose greedy output equals the model-dtype cache's
    num_prompts: int = 0


def greedy_tokens(engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from pagedcore import SamplingParams

    for i, p in enumerate(prompts):
        engine.add_request(f"a{i}", p, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    check_pool_whole(engine)
    return [done[f"a{i}"] for i in range(len(prompts))]


def agreement(got: list[list[int]], want: list[list[int]]) -> tuple[float, int]:
    """(tokens before the first divergence / all tokens, prompts identical all the way)."""
    same = sum(next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w)))
               for g, w in zip(got, want))
    return same / max(1, sum(len(w) for w in want)), sum(g == w for g, w in zip(got, want))


def kv_capacity(model_dir: str, args, budget_bytes: int) -> list[KVCapacity]:
    """One engine per kv_cache_dtype (the first is the reference): its bytes per block sizes the budget,
    and, with --agreement-tokens, its greedy output on AGREEMENT_PROMPTS is compared with the first's."""
    rows, ref_tokens, ref_blocks = [], None, None
    for name in args.kv_cache_dtypes.split(","):
        engine = make_engine(model_dir, args, kv_cache_dtype=name, num_kv_blocks=256, num_cpu_blocks=0)
        bytes_per_block = engine.runner.bytes_per_block()
        blocks = budget_bytes // bytes_per_block
        ref_blocks = ref_blocks or blocks
        row = KVCapacity(name, bytes_per_block, blocks, args.capacity_seq_len,
                         blocks // cdiv(args.capacity_seq_len, args.block_size), round(blocks / ref_blocks, 3))
        if args.agreement_tokens:
            prompts = [list(engine.tokenizer.apply_chat_template([{"role": "user", "content": p}],
                                                                 add_generation_prompt=True, tokenize=True,
                                                                 return_dict=False)) for p in AGREEMENT_PROMPTS]
            tokens = greedy_tokens(engine, prompts, args.agreement_tokens)
            ref_tokens = ref_tokens or tokens
            frac, identical = agreement(tokens, ref_tokens)
            row.agreement, row.identical_prompts, row.num_prompts = round(frac, 4), identical, len(prompts)
        rows.append(row)
        del engine
    return rows


def capacity_rows(report: dict) -> list[tuple[str, str]]:
    rows = []
    for c in report.get("kv_capacity", []):
        what = f"kv_cache_dtype {c['kv_cache_dtype']}"
        value = (f"{c['budget_blocks']} blocks of {c['bytes_per_block'] / 1024:g} KiB ({c['vs_model_dtype']:g}x), "
                 f"{c['max_seqs']} sequences of {c['seq_len']} tokens")
        if c.get("agreement") is not None:
            value += (f"; greedy agreement {c['agreement']:.3f}, "
                      f"{c['identical_prompts']}/{c['num_prompts']} prompts identical")
        rows.append((f"{what}, {report['concurrency']['kv_budget_mib']:g} MiB of KV", value))
    return rows

"""Quantized KV cache on the bundled model, end to end (EngineConfig.kv_cache_dtype "int8" / "fp8_e4m3").

Greedy output with int8 KV tracks the fp32 cache on the chat prompts (agreement measured, a floor asserted),
prefix caching and swap / recompute preemption change nothing under int8, every block comes back, and the same
byte budget holds >= 1.9x the blocks of bf16. The kernels and settings: tests/test_kv_cache_quant.py.
"""

from __future__ import annotations

import pytest

from pagedcore import LLM, SamplingParams
from pagedcore.kernels import kv_quant

QUANT = ["int8", "fp8_e4m3"]


def _prefill_kernel_here() -> bool:
    from pagedcore.kernels import cpu_ext

    ext = cpu_ext.load()
    return ext is not None and ext.paged_prefill_supported(64)


# ---------------------------------------------------------------- the engine on the bundled model (fp32)

MAX_NEW = 48


def greedy(model_dir, prompts, max_new=MAX_NEW, **settings):
    """Greedy token ids; checks that every block (GPU pool and CPU swap pool) came back."""
    settings.setdefault("num_kv_blocks", 512)
    llm = LLM(str(model_dir), dtype="float32", **settings)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True), use_tqdm=False)
    kv = llm.engine.kv
    assert kv.num_free_blocks == kv.num_blocks, "blocks leaked"
    assert kv.cpu_pool is None or kv.cpu_pool.num_free_blocks == kv.cpu_pool.num_blocks, "CPU blocks leaked"
    return llm, [o.outputs[0].token_ids for o in outs]


def agreement(got: list[list[int]], want: list[list[int]]) -> tuple[float, int]:
    """(tokens before the first divergence / all tokens, prompts identical all the way)."""
    same = 0
    for g, w in zip(got, want):
        same += next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w)))
    return same / sum(len(w) for w in want), sum(g == w for g, w in zip(got, want))


@pytest.fixture(scope="module")
def fp32_cache_greedy(smollm2_dir, chat_prompt_ids):
    return greedy(smollm2_dir, chat_prompt_ids)[1]


# Free-running agreement (tokens before each prompt's first divergence) is chaotic: one early flip at a near-tie ends a
# whole prompt's count, and the fp32 roundings of each CPU move which ties flip (fp8 e4m3 measured 0.417 and 1 of 8
# prompts identical on an AVX2 EPYC in session 11, 0.292 and 0 of 8 on an AMD Zen 3 in session 28 with the C++ ops,
# 0.391 and 1 with the torch paths). Teacher-forced, every position is judged on the fp32 run's own context: the
# quantized cache's next token against the fp32 run's, 8 prompts x 48 positions. Measured on the Zen 3: int8
# 0.974 (torch paths 0.982), fp8 e4m3 0.940 (0.948), the fp32 cache itself 1.000; floors below that.
FLOORS = {"int8": 0.95, "fp8_e4m3": 0.90}


def teacher_forced(model_dir, prompts, reference, **settings) -> list[int]:
    """The next token after each prompt + reference[:t], t < len(reference): one prompt row each, so the quantized cache
    holds the whole context (written, then read back by the attention)."""
    llm = LLM(str(model_dir), dtype="float32", num_kv_blocks=1024, **settings)
    forced = [p + r[:t] for p, r in zip(prompts, reference) for t in range(len(r))]
    outs = llm.generate(forced, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks, "blocks leaked"
    return [o.outputs[0].token_ids[0] for o in outs]


@pytest.mark.slow
@pytest.mark.parametrize("kv_cache_dtype", QUANT)
def test_greedy_with_quantized_kv_tracks_the_fp32_cache(kv_cache_dtype, smollm2_dir, chat_prompt_ids,
                                                        fp32_cache_greedy):
    llm, got = greedy(smollm2_dir, chat_prompt_ids, kv_cache_dtype=kv_cache_dtype)
    assert kv_quant.layout_of(llm.engine.runner.kv_caches[0][0]).kv_cache_dtype == kv_cache_dtype
    frac, exact = agreement(got, fp32_cache_greedy)
    forced = teacher_forced(smollm2_dir, chat_prompt_ids, fp32_cache_greedy, kv_cache_dtype=kv_cache_dtype)
    want = [t for r in fp32_cache_greedy for t in r]
    forced_frac = sum(a == b for a, b in zip(forced, want)) / len(want)
    print(f"{kv_cache_dtype}: free-running {frac:.3f} of the tokens, {exact}/{len(got)} prompts identical; "
          f"teacher-forced {forced_frac:.3f} of {len(want)} positions")
    assert forced_frac >= FLOORS[kv_cache_dtype], forced_frac


def test_teacher_forced_fp32_cache_gives_the_greedy_tokens(smollm2_dir, chat_prompt_ids, fp32_cache_greedy):
    # The measure's own zero: the fp32 cache, forced on its own greedy tokens, picks them again (prompt rows and
    # decode rows agree up to last bits, far from the ties that would move a token here).
    forced = teacher_forced(smollm2_dir, chat_prompt_ids[:2], fp32_cache_greedy[:2])
    assert forced == [t for r in fp32_cache_greedy[:2] for t in r]


# Prefix caching alone, swap or recompute preemption alone: bit for bit what the engine gives without them.
# Prefix caching with recompute: the tokens computed through a different mix of paths (prefill chunks, decode steps,
# cached blocks) differ in their last fp32 bits, and now and then such a difference moves a value across
# an int8 rounding boundary, so greedy output may part at a near-tie (as fp32 runs do against transformers).
PREFIX_SWAP = dict(num_kv_blocks=24, preemption_mode="swap", num_cpu_blocks=64)
EXACT = {
    "prefix": dict(),
    "swap": dict(enable_prefix_caching=False, num_kv_blocks=24, preemption_mode="swap", num_cpu_blocks=64),
    "recompute": dict(enable_prefix_caching=False, num_kv_blocks=24, preemption_mode="recompute"),
    # Where the C++ prefill kernel runs (AVX-512), a prompt's tail after a prefix-cache hit gets the values the
    # whole prompt gets (short prompt chunks no longer run as decode rows: torch_backend.py), so prefix hits with
    # swaps change nothing either; elsewhere this one is a near-tie case.
    "prefix-swap": PREFIX_SWAP,
}
NEAR_TIE_OK = {
    "prefix-swap": PREFIX_SWAP,
    "prefix-recompute": dict(num_kv_blocks=24, preemption_mode="recompute"),
}
# Logprob gap between the two tokens where the runs part (recompute: the generated tokens' K/V come back from the
# prefill kernel, first written by the decode kernel). Measured: one prompt parts at step 5 at a gap of 0.071
# under both settings on the AVX2 EPYC, at step 15 at 0.192 (prefix-swap) on the AVX-512 / AMX Xeon, at step 15 at
# 0.105 (prefix-recompute) on the AVX-512 Xeon without AMX; int8 KV's own noise moves greedy choices at such gaps
# (it agrees with the fp32 cache on 0.59-0.69 of the tokens), and fp32 caches part from each other only below ~1e-3.
NEAR_TIE = 0.25


def shared_prefix_prompts(chat_prompt_ids):
    """Six chat prompts behind one 40-token system prefix: prefix-cache hits on its 2 full blocks."""
    prefix = chat_prompt_ids[6][:40]
    return [prefix + p for p in chat_prompt_ids[:6]]


def greedy_outputs(model_dir, prompts, **settings):
    settings.setdefault("num_kv_blocks", 512)
    llm = LLM(str(model_dir), dtype="float32", kv_cache_dtype="int8", **settings)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=2),
                        use_tqdm=False)
    kv = llm.engine.kv
    assert kv.num_free_blocks == kv.num_blocks, "blocks leaked"
    assert kv.cpu_pool is None or kv.cpu_pool.num_free_blocks == kv.cpu_pool.num_blocks, "CPU blocks leaked"
    return llm, [o.outputs[0] for o in outs]


@pytest.fixture(scope="module")
def int8_plain(smollm2_dir, chat_prompt_ids):
    """int8 KV without prefix caching and without preemption: the reference of the tests below."""
    return greedy_outputs(smollm2_dir, shared_prefix_prompts(chat_prompt_ids), enable_prefix_caching=False)[1]


def check_preempted(llm, settings):
    if "preemption_mode" in settings:
        assert llm.engine.scheduler.num_preemptions > 0, "the KV budget did not force preemption"
    if settings.get("enable_prefix_caching", True):
        assert llm.engine.kv.pool.cached_blocks, "no block was kept for prefix reuse"
        if "preemption_mode" in settings:  # (with room for all, the six prompts start in one step: no hits)
            assert llm.engine.kv.num_prefix_hit_tokens > 0, "no prompt reused a cached prefix"


@pytest.mark.slow
@pytest.mark.parametrize("name", list(EXACT))
def test_prefix_caching_or_preemption_alone_change_nothing_under_int8_kv(name, smollm2_dir, chat_prompt_ids,
                                                                         int8_plain):
    if name == "prefix-swap" and not _prefill_kernel_here():
        pytest.skip("without the C++ prefill kernel, prefix hits with swaps may part at near-ties (tested below)")
    llm, got = greedy_outputs(smollm2_dir, shared_prefix_prompts(chat_prompt_ids), **EXACT[name])
    check_preempted(llm, EXACT[name])
    assert [o.token_ids for o in got] == [o.token_ids for o in int8_plain]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(NEAR_TIE_OK))
def test_prefix_caching_with_preemption_parts_only_at_near_ties_under_int8_kv(name, smollm2_dir, chat_prompt_ids,
                                                                               int8_plain):
    if name == "prefix-swap" and _prefill_kernel_here():
        pytest.skip("exact here (tested above)")
    llm, got = greedy_outputs(smollm2_dir, shared_prefix_prompts(chat_prompt_ids), **NEAR_TIE_OK[name])
    check_preempted(llm, NEAR_TIE_OK[name])
    parted = []
    for g, w in zip(got, int8_plain):
        t = next((i for i, (a, b) in enumerate(zip(g.token_ids, w.token_ids)) if a != b), None)
        if t is None:
            continue
        a, b = w.token_ids[t], g.token_ids[t]
        assert a in w.logprobs[t] and b in w.logprobs[t], f"step {t}: {b} not among the reference's top tokens"
        gap = w.logprobs[t][a].logprob - w.logprobs[t][b].logprob
        assert gap < NEAR_TIE, f"step {t}: parted at a logprob gap of {gap:.3f} (not a near-tie)"
        parted.append((t, round(gap, 4)))
    print(f"{name}: {len(parted)} of {len(got)} prompts parted (step, gap): {parted}")
    assert len(parted) <= 2, parted


@pytest.mark.slow
def test_same_kv_memory_holds_1_9x_the_blocks_of_bf16(smollm2_dir):
    budget = 64 << 20
    blocks = {}
    for kv_cache_dtype in ("auto", "int8", "fp8_e4m3"):
        llm = LLM(str(smollm2_dir), dtype="bfloat16", kv_cache_memory=budget, kv_cache_dtype=kv_cache_dtype,
                  swap_space=0, pack_weights=False)
        runner = llm.engine.runner
        blocks[kv_cache_dtype] = runner.num_blocks
        assert runner.num_blocks * runner.bytes_per_block() <= budget
        assert llm.engine.kv.num_blocks == runner.num_blocks
        del llm
    assert blocks["int8"] / blocks["auto"] >= 1.9, blocks
    assert blocks["fp8_e4m3"] == blocks["int8"]


@pytest.mark.slow
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_a_prompt_after_a_prefix_hit_gets_what_it_gets_whole(kv_cache_dtype, smollm2_dir, chat_prompt_ids):
    """The tail of a prompt after a prefix-cache hit (8 tokens here, a chunk short enough to have run as decode
    rows) gives the first tokens' logprobs bit for bit as the whole prompt does (fp32 model and cache, or int8)."""
    from pagedcore.kernels import cpu_ext

    ext = cpu_ext.load()
    if ext is None or not ext.paged_prefill_supported(64):
        pytest.skip("the C++ prefill kernel runs on AVX-512 CPUs only")
    prompts = shared_prefix_prompts(chat_prompt_ids)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2)
    runs = []
    for caching in (False, True):
        llm = LLM(str(smollm2_dir), dtype="float32", kv_cache_dtype=kv_cache_dtype, enable_prefix_caching=caching,
                  num_kv_blocks=64)
        llm.generate(prompts[:1], params, use_tqdm=False)
        runs.append(llm.generate(prompts[4:5], params, use_tqdm=False)[0].outputs[0])
        hit = llm.engine.kv.num_prefix_hit_tokens
        assert (hit > 0) == caching and (not caching or len(prompts[4]) - hit <= 16), hit
        del llm
    whole, tail = runs
    assert tail.token_ids == whole.token_ids
    assert [lp[t].logprob for lp, t in zip(tail.logprobs, tail.token_ids)] == \
        [lp[t].logprob for lp, t in zip(whole.logprobs, whole.token_ids)]

"""Sharing and pressure on the real model: n / best_of / beam search over shared blocks, swap and
recompute preemption, prefix caching; outputs identical with and without each."""

from __future__ import annotations

import pytest
import torch

from pagedcore import LLM, SamplingParams, hookimpl

GREEDY = SamplingParams(temperature=0, max_tokens=32)
SYSTEM = ("You are a meticulous assistant who answers briefly and precisely, citing no sources, "
          "never using lists, and always staying polite. ") * 12


def assert_pool_whole(llm: LLM) -> None:
    kv = llm.engine.kv
    assert kv.num_free_blocks == kv.num_blocks, "device blocks leaked"
    if kv.cpu_pool is not None:
        assert kv.cpu_pool.num_free_blocks == kv.cpu_pool.num_blocks, "cpu blocks leaked"


def token_ids(outputs):
    return [[c.token_ids for c in o.outputs] for o in outputs]


class Events:
    def __init__(self):
        self.preempted = []

    @hookimpl
    def pagedcore_request_event(self, event, request_id, seq_index, info):
        if event == "preempted":
            self.preempted.append(info["mode"])


@pytest.fixture(scope="module")
def baseline(smollm2_dir, chat_prompt_ids):
    llm = LLM(str(smollm2_dir), num_kv_blocks=400, enable_prefix_caching=False)
    outs = llm.generate(chat_prompt_ids, GREEDY, use_tqdm=False)
    assert_pool_whole(llm)
    return token_ids(outs)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preempted_requests_resume_with_identical_tokens(mode, smollm2_dir, chat_prompt_ids, baseline):
    events = Events()
    llm = LLM(str(smollm2_dir), num_kv_blocks=20, num_cpu_blocks=64, preemption_mode=mode,
              enable_prefix_caching=False, plugins=[events])
    outs = llm.generate(chat_prompt_ids, GREEDY, use_tqdm=False)
    assert token_ids(outs) == baseline
    sched = llm.engine.scheduler
    assert sched.num_preemptions > 0 and set(events.preempted) == {mode}
    assert (sched.num_swap_outs > 0) == (mode == "swap") and (sched.num_recomputes > 0) == (mode == "recompute")
    assert_pool_whole(llm)


def test_auto_preemption_swaps_long_and_recomputes_short(smollm2_dir, chat_prompt_ids, baseline):
    events = Events()
    llm = LLM(str(smollm2_dir), num_kv_blocks=20, num_cpu_blocks=64, swap_min_tokens=60,
              enable_prefix_caching=False, plugins=[events])
    assert token_ids(llm.generate(chat_prompt_ids, GREEDY, use_tqdm=False)) == baseline
    assert set(events.preempted) == {"swap", "recompute"}
    assert_pool_whole(llm)


def test_prefix_caching_on_off_warm_cold_identical(smollm2_dir, smollm2_tokenizer):
    questions = ["What is 2+2?", "Name a color.", "Say hi.", "What is the capital of Italy?", "Count to three.",
                 "Spell cat.", "Is water wet?", "Name a fruit.", "Give me a number.", "What day follows Monday?"]
    prompts = [list(smollm2_tokenizer.apply_chat_template(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}], add_generation_prompt=True,
        tokenize=True, return_dict=False)) for q in questions]
    assert len(prompts[0]) > 250
    off = LLM(str(smollm2_dir), num_kv_blocks=400, enable_prefix_caching=False)
    ref = token_ids(off.generate(prompts, GREEDY, use_tqdm=False))
    on = LLM(str(smollm2_dir), num_kv_blocks=400, enable_prefix_caching=True, max_num_batched_tokens=512)
    cold = on.generate(prompts, GREEDY, use_tqdm=False)
    warm = on.generate(prompts, GREEDY, use_tqdm=False)
    assert token_ids(cold) == ref and token_ids(warm) == ref
    assert all(o.num_cached_tokens >= len(prompts[0]) // 16 * 16 - 16 for o in warm)
    assert sum(o.num_cached_tokens for o in cold) > 0, "later cold requests reuse the system prompt"
    # Caching under pressure: evictions happen and outputs still match.
    tight = LLM(str(smollm2_dir), enable_prefix_caching=True, num_kv_blocks=40, max_num_batched_tokens=512)
    assert token_ids(tight.generate(prompts, GREEDY, use_tqdm=False)) == ref
    assert tight.engine.kv.pool.num_evictions > 0
    for llm in (off, on, tight):
        assert_pool_whole(llm)


def test_n_samples_share_prompt_blocks(smollm2_dir, smollm2_tokenizer):
    prompt = list(smollm2_tokenizer.apply_chat_template(
        [{"role": "system", "content": SYSTEM * 2}, {"role": "user", "content": "Tell me a story."}],
        add_generation_prompt=True, tokenize=True, return_dict=False))
    params = SamplingParams(temperature=0.8, seed=7, max_tokens=8)

    def peak_blocks(llm, submit):
        peak = 0
        submit(llm.engine)
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
            peak = max(peak, llm.engine.kv.num_blocks - llm.engine.kv.num_free_blocks)
        assert_pool_whole(llm)
        return peak

    shared = LLM(str(smollm2_dir), num_kv_blocks=400, enable_prefix_caching=False)
    shared_peak = peak_blocks(shared, lambda e: e.add_request("n4", prompt, SamplingParams(
        n=4, temperature=0.8, seed=7, max_tokens=8)))
    independent = LLM(str(smollm2_dir), num_kv_blocks=400, enable_prefix_caching=False)
    indep_peak = peak_blocks(independent, lambda e: [e.add_request(f"r{i}", prompt, params) for i in range(4)])
    prompt_blocks = -(-len(prompt) // 16)
    print(f"\nn=4 on a {len(prompt)}-token prompt: {shared_peak} blocks shared vs {indep_peak} independent")
    assert indep_peak >= 4 * prompt_blocks
    assert shared_peak <= prompt_blocks + 4 * 2  # the prompt once, plus each sample's own tail blocks


def test_seeded_n_and_best_of_reproducible(smollm2_dir, chat_prompt_ids):
    llm = LLM(str(smollm2_dir), num_kv_blocks=400)
    p = SamplingParams(n=3, temperature=0.9, top_p=0.95, seed=11, max_tokens=24)
    a = llm.generate(chat_prompt_ids[:3], p, use_tqdm=False)
    b = llm.generate(chat_prompt_ids[:3] + chat_prompt_ids[3:5], p, use_tqdm=False)[:3]
    assert token_ids(a) == token_ids(b)
    assert len({tuple(c.token_ids) for c in a[0].outputs}) > 1, "samples of one request should differ"
    c = llm.generate(chat_prompt_ids[:1], SamplingParams(n=3, temperature=0.9, top_p=0.95, seed=12, max_tokens=24),
                     use_tqdm=False)
    assert token_ids(c) != token_ids(a[:1])
    best = llm.generate(chat_prompt_ids[:1], SamplingParams(n=2, best_of=5, temperature=1.0, seed=3, max_tokens=16),
                        use_tqdm=False)[0]
    assert len(best.outputs) == 2
    assert best.outputs[0].cumulative_logprob >= best.outputs[1].cumulative_logprob
    assert_pool_whole(llm)


@pytest.fixture(scope="module")
def hf_smollm2(smollm2_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()


@pytest.mark.parametrize("width", [2, 4])
def test_beam_search_equals_transformers(width, smollm2_dir, chat_prompt_ids, hf_smollm2):
    prompts = chat_prompt_ids[:6]
    llm = LLM(str(smollm2_dir), num_kv_blocks=120)  # tight enough that beams also get preempted
    outs = llm.generate(prompts, SamplingParams(use_beam_search=True, best_of=width, n=2, max_tokens=24),
                        use_tqdm=False)
    for p, out in zip(prompts, outs):
        with torch.inference_mode():
            ref = hf_smollm2.generate(torch.tensor([p]), num_beams=width, num_return_sequences=2, max_new_tokens=24,
                                      do_sample=False, return_dict_in_generate=True, output_scores=True)
        for j, o in enumerate(out.outputs):
            expect = ref.sequences[j, len(p):].tolist()
            expect = expect[:len(o.token_ids)] if expect[len(o.token_ids):] == [2] * (len(expect) - len(o.token_ids)) \
                else expect  # transformers pads shorter beams with eos
            assert o.token_ids == expect
            assert abs(o.score - ref.sequences_scores[j].item()) < 1e-4
    assert_pool_whole(llm)

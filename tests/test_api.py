"""The offline API (LLM.generate / LLM.chat): what a caller gets back, how it stops, its logprobs.

Plumbing runs on the tiny random-weight Llama; stop strings, logprobs against transformers and
anything where the text must mean something run on the bundled SmolLM2. Engines: conftest.py; sampling
(seeds, n, best_of): test_api_sampling.py; the LLMEngine step loop: test_engine_step_loop.py.
"""

from __future__ import annotations

import pytest
import torch

from api_helpers import FRANCE, assert_pool_whole, gen1, greedy, tiny_prompts
from conftest import assert_greedy_equal, hf_greedy
from pagedcore import SamplingParams


# ---- prompts, outputs, metrics ----------------------------------------------------------
def test_string_and_token_id_prompts_give_one_output_each_in_prompt_order(tiny):
    tok = tiny.get_tokenizer()
    ids = tiny_prompts(2)
    prompts = ["Hello, my name is", ids[0], "The sky is", ids[1]]
    outs = tiny.generate(prompts, greedy(6, ignore_eos=True, logprobs=2), use_tqdm=False)

    assert len(outs) == len(prompts)
    assert len({o.request_id for o in outs}) == len(prompts)
    for prompt, out in zip(prompts, outs):
        if isinstance(prompt, str):
            assert out.prompt == prompt
            assert out.prompt_token_ids == tok.encode(prompt)
        else:
            assert out.prompt is None
            assert out.prompt_token_ids == prompt
        assert out.finished
        (c,) = out.outputs
        assert c.index == 0
        assert len(c.token_ids) == 6 and all(isinstance(t, int) for t in c.token_ids)
        assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)
        assert c.finish_reason == "length" and c.stop_reason is None
        assert len(c.logprobs) == 6 and all(t in d for t, d in zip(c.token_ids, c.logprobs))
        assert c.cumulative_logprob == pytest.approx(sum(d[t].logprob for t, d in zip(c.token_ids, c.logprobs)),
                                                     abs=1e-4)
        m = out.metrics
        assert m is not None
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
        assert m.time_to_first_token >= 0
    assert_pool_whole(tiny.engine)


def test_a_single_prompt_is_a_list_of_one(tiny):
    ids = tiny_prompts(1)[0]
    as_ids = tiny.generate(ids, greedy(4), use_tqdm=False)
    as_str = tiny.generate("Hello", greedy(4), use_tqdm=False)
    assert len(as_ids) == 1 and as_ids[0].prompt_token_ids == ids
    assert len(as_str) == 1 and as_str[0].prompt == "Hello"
    assert_pool_whole(tiny.engine)


def test_string_prompt_and_its_token_ids_generate_the_same(tiny):
    text = "Once upon a time"
    a, b = tiny.generate([text, tiny.get_tokenizer().encode(text)], greedy(8), use_tqdm=False)
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert a.outputs[0].text == b.outputs[0].text
    assert_pool_whole(tiny.engine)


def test_no_logprobs_unless_asked(tiny):
    """A greedy request without logprobs reports no cumulative logprob either (as vLLM v1: its logits may never all
    be computed, pagedcore/greedy_head.py); logprobs=0 asks for it without top-N entries."""
    c = gen1(tiny, "Hi", greedy(3))
    assert c.logprobs is None and c.cumulative_logprob is None
    c = gen1(tiny, "Hi", SamplingParams(temperature=0, max_tokens=3, logprobs=0))
    assert c.cumulative_logprob is not None and c.cumulative_logprob < 0
    assert len(c.logprobs) == 3 and all(len(d) == 1 for d in c.logprobs)
    assert_pool_whole(tiny.engine)


def test_temperature_zero_is_greedy_repeatable_and_equals_transformers(tiny, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    prompts = tiny_prompts(3, seed=7)
    params = greedy(12, ignore_eos=True, logprobs=3)
    first = tiny.generate(prompts, params, use_tqdm=False)
    second = tiny.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in second]
    assert [o.outputs[0].text for o in first] == [o.outputs[0].text for o in second]
    for o in first:
        c = o.outputs[0]
        # greedy: every sampled token is the top-1 of its step
        assert all(d[t].rank == 1 for t, d in zip(c.token_ids, c.logprobs))

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir("llama")), dtype=torch.float32)
    with torch.inference_mode():
        for p, o in zip(prompts, first):
            ref, ref_lps = hf_greedy(model, p, 12)
            assert_greedy_equal(o.outputs[0].token_ids, o.outputs[0].logprobs, ref, ref_lps)
    assert_pool_whole(tiny.engine)


def test_chat_applies_the_template(smol, france, france_greedy):
    (out,) = smol.chat([{"role": "user", "content": FRANCE}], greedy(24), use_tqdm=False)
    assert out.prompt_token_ids == france
    assert out.outputs[0].text == france_greedy.text
    assert_pool_whole(smol.engine)


# ---- stopping --------------------------------------------------------------------------------
def test_max_tokens_finishes_with_length_and_exactly_max_tokens(tiny):
    for n in (1, 5, 17):
        c = gen1(tiny, tiny_prompts(1, seed=n)[0], greedy(n))
        assert c.finish_reason == "length"
        assert c.stop_reason is None
        assert len(c.token_ids) == n
    assert_pool_whole(tiny.engine)


def test_eos_stops_with_finish_reason_stop_and_no_special_text(smol, tok, france_greedy):
    c = france_greedy
    assert c.token_ids[-1] == tok.eos_token_id
    assert c.stop_reason is None  # EOS is not a user stop token
    assert tok.eos_token not in c.text
    assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)
    assert_pool_whole(smol.engine)


def test_default_sampling_params_are_vllms(tiny):
    """No params: temperature 1 sampling, at most 16 tokens (vLLM's defaults)."""
    p = SamplingParams()
    assert p.temperature == 1.0 and p.max_tokens == 16 and not p.greedy
    (out,) = tiny.generate("Hello", use_tqdm=False)
    c = out.outputs[0]
    assert 1 <= len(c.token_ids) <= 16
    if c.finish_reason == "length":
        assert len(c.token_ids) == 16
    assert_pool_whole(tiny.engine)


def test_min_tokens_suppresses_eos(smol, france, france_greedy):
    n_eos = len(france_greedy.token_ids)  # EOS was the last of these
    want = n_eos + 4
    c = gen1(smol, france, greedy(want + 8, min_tokens=want))
    eos = smol.engine.eos_token_ids
    assert len(c.token_ids) >= want
    assert not eos & set(c.token_ids[:want]), "EOS sampled before min_tokens"
    # Up to where EOS came, nothing changes.
    assert c.token_ids[:n_eos - 1] == france_greedy.token_ids[:-1]
    assert_pool_whole(smol.engine)


def test_min_tokens_also_blocks_stop_token_ids(smol, france, france_greedy):
    stop_id = france_greedy.token_ids[2]
    c = gen1(smol, france, greedy(10, min_tokens=5, stop_token_ids=[stop_id]))
    assert stop_id not in c.token_ids[:5]
    assert_pool_whole(smol.engine)


def test_stop_token_id_stops_with_that_id_as_stop_reason(smol, tok, france, france_greedy):
    stop_id = france_greedy.token_ids[4]
    assert stop_id not in france_greedy.token_ids[:4]
    c = gen1(smol, france, greedy(24, stop_token_ids=[stop_id]))
    assert c.finish_reason == "stop"
    assert c.stop_reason == stop_id
    assert c.token_ids == france_greedy.token_ids[:5]
    # As vLLM documents: a non-special stop token stays in the output.
    assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)
    assert_pool_whole(smol.engine)


@pytest.mark.parametrize("stop", ["lapping of", "pping", "\nA gentle"])
def test_stop_string_is_cut_and_not_in_text(smol, haiku, haiku_greedy, stop):
    full = haiku_greedy.text
    k = full.find(stop)
    assert k > 0, f"{stop!r} not in the greedy text {full!r}"
    c = gen1(smol, haiku, greedy(24, stop=[stop, "never appears here"]))
    assert c.finish_reason == "stop"
    assert c.stop_reason == stop
    assert c.text == full[:k]
    assert stop not in c.text
    # generation stopped right there: the tokens are a strict prefix of the unconstrained run
    assert len(c.token_ids) < len(haiku_greedy.token_ids)
    assert c.token_ids == haiku_greedy.token_ids[:len(c.token_ids)]
    assert_pool_whole(smol.engine)


def test_first_completed_stop_string_wins(smol, haiku, haiku_greedy):
    full = haiku_greedy.text
    early, late = "sea", "gentle"
    assert 0 < full.find(early) < full.find(late)
    c = gen1(smol, haiku, greedy(24, stop=[late, early]))
    assert c.stop_reason == early
    assert c.text == full[:full.find(early)]
    assert_pool_whole(smol.engine)


def test_include_stop_str_in_output_keeps_the_stop_string(smol, haiku, haiku_greedy):
    stop = "lapping of"
    full = haiku_greedy.text
    k = full.find(stop)
    c = gen1(smol, haiku, greedy(24, stop=[stop], include_stop_str_in_output=True))
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.text == full[:k + len(stop)]
    assert_pool_whole(smol.engine)


def test_stop_string_inside_min_tokens_is_ignored(smol, france, france_greedy):
    """vLLM: stop strings only count once min_tokens tokens are out (like EOS and stop ids)."""
    full = france_greedy.text  # "The capital of France is Paris."
    assert full.find("capital") >= 0
    c = gen1(smol, france, greedy(24, stop=["capital"], min_tokens=5))
    # "capital" came before 5 tokens: no stop, and the text is NOT cut there
    assert c.text == full
    assert c.token_ids == france_greedy.token_ids
    assert c.finish_reason == "stop" and c.stop_reason is None  # ended by EOS
    # a stop string completed after min_tokens still stops
    k = full.find("Paris")
    c = gen1(smol, france, greedy(24, stop=["Paris"], min_tokens=3))
    assert c.stop_reason == "Paris" and c.text == full[:k]
    assert_pool_whole(smol.engine)


def test_ignore_eos_runs_to_max_tokens(smol, tok, france, france_greedy):
    n_eos = len(france_greedy.token_ids)
    c = gen1(smol, france, greedy(n_eos + 5, ignore_eos=True))
    assert c.finish_reason == "length"
    assert len(c.token_ids) == n_eos + 5
    assert c.token_ids[:n_eos] == france_greedy.token_ids  # EOS sampled, and went past it
    assert c.text.startswith(france_greedy.text)
    assert tok.eos_token not in c.text
    assert_pool_whole(smol.engine)


# ---- logprobs ------------------------------------------------------------------------------
def test_logprobs_are_log_softmax_of_the_model_logits(smol, smollm2_dir, france):
    from transformers import AutoModelForCausalLM

    N = 5
    c = gen1(smol, france, SamplingParams(temperature=1.5, top_p=0.95, seed=11, max_tokens=8, logprobs=N,
                                          ignore_eos=True))
    assert len(c.logprobs) == len(c.token_ids) == 8

    model = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32)
    with torch.inference_mode():
        logits = model(torch.tensor([france + c.token_ids])).logits[0]
    ref = torch.log_softmax(logits.float(), -1)[len(france) - 1:-1]  # the step that sampled token t

    for t, (tid, d) in enumerate(zip(c.token_ids, c.logprobs)):
        ranked = sorted(((lp.rank, tok_id) for tok_id, lp in d.items() if lp.rank is not None))
        assert [r for r, _ in ranked] == list(range(1, N + 1)), d
        top_ref = ref[t].topk(N)
        assert [tok_id for _, tok_id in ranked] == top_ref.indices.tolist()
        for tok_id, lp in d.items():
            assert lp.logprob == pytest.approx(ref[t, tok_id].item(), abs=2e-4)
        assert tid in d
        assert len(d) in (N, N + 1)  # the sampled token is added when it is not in the top N
        if tid not in top_ref.indices.tolist():
            assert len(d) == N + 1
    assert c.cumulative_logprob == pytest.approx(sum(ref[t, tid].item() for t, tid in enumerate(c.token_ids)),
                                                 abs=1e-3)
    assert_pool_whole(smol.engine)


def test_logprobs_zero_gives_only_the_sampled_token(tiny):
    c = gen1(tiny, "Hi there", greedy(4, logprobs=0))
    assert [list(d) for d in c.logprobs] == [[t] for t in c.token_ids]
    assert_pool_whole(tiny.engine)


"""The offline API (LLM.generate / LLM.chat) and the LLMEngine step loop: what a caller gets back.

Plumbing runs on the tiny random-weight Llama; stop strings, logprobs against transformers and
anything where the text must mean something run on the bundled SmolLM2.
"""

from __future__ import annotations

import pytest
import torch

from conftest import assert_greedy_equal, hf_greedy
from pagedcore import LLM, OutputKind, SamplingParams

# One torch thread: on a small shared machine, oversubscribed threads make each step ~10x slower.
ENGINE: dict = {}
FRANCE = "What is the capital of France?"
HAIKU = "Write a haiku about the sea."


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def assert_pool_whole(engine) -> None:
    assert engine.kv.num_free_blocks == engine.kv.num_blocks, "KV blocks leaked"
    assert not engine.has_unfinished_requests(), f"requests left: {list(engine.requests)}"
    assert not engine.scheduler.waiting and not engine.scheduler.running


def drain(engine, max_steps: int = 2000) -> dict[str, list]:
    """Step until idle; every RequestOutput, grouped by request id, in order."""
    seen: dict[str, list] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return seen
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(out)
    raise AssertionError("the engine did not finish")


def gen1(llm, prompt, params):
    """One prompt -> its CompletionOutput (n=1)."""
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    (comp,) = out.outputs
    return comp


# ---- engines ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    llm = LLM(str(tiny_model_dir("llama")), num_kv_blocks=64, block_size=8, **ENGINE)
    yield llm
    assert_pool_whole(llm.engine)


@pytest.fixture(scope="module")
def smol(smollm2_dir):
    llm = LLM(str(smollm2_dir), num_kv_blocks=64, block_size=16, **ENGINE)
    yield llm
    assert_pool_whole(llm.engine)


@pytest.fixture(scope="module")
def tok(smol):
    return smol.get_tokenizer()


@pytest.fixture(scope="module")
def france(smol):
    return smol.apply_chat_template([{"role": "user", "content": FRANCE}])


@pytest.fixture(scope="module")
def haiku(smol):
    return smol.apply_chat_template([{"role": "user", "content": HAIKU}])


@pytest.fixture(scope="module")
def france_greedy(smol, france):
    """Unconstrained greedy answer; it ends with EOS well before 24 tokens."""
    c = gen1(smol, france, greedy(24))
    assert c.finish_reason == "stop" and c.token_ids[-1] in smol.engine.eos_token_ids, c
    assert "Paris" in c.text
    return c


@pytest.fixture(scope="module")
def haiku_greedy(smol, haiku):
    c = gen1(smol, haiku, greedy(24))
    assert c.finish_reason == "length" and len(c.token_ids) == 24
    return c


def tiny_prompts(n: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 49152, (int(k),), generator=g).tolist()
            for k in torch.randint(4, 30, (n,), generator=g)]


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
    c = gen1(tiny, "Hi", greedy(3))
    assert c.logprobs is None
    assert c.cumulative_logprob is not None and c.cumulative_logprob < 0
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


# ---- sampling: seeds, n, best_of -------------------------------------------------------------
def sampled(seed, **kw):
    return SamplingParams(temperature=0.8, top_p=0.9, seed=seed, max_tokens=16, ignore_eos=True, **kw)


def test_seeded_sampling_is_reproducible_alone_and_in_any_batch(tiny):
    target = tiny_prompts(1, seed=42)[0]
    alone = gen1(tiny, target, sampled(1234)).token_ids
    again = gen1(tiny, target, sampled(1234)).token_ids
    assert alone == again

    others = tiny_prompts(4, seed=43)
    prompts = [others[0], target, others[1], others[2], others[3]]
    params = [sampled(1), sampled(1234), SamplingParams(temperature=1.0, max_tokens=20), greedy(10), sampled(7)]
    in_batch = tiny.generate(prompts, params, use_tqdm=False)[1].outputs[0].token_ids
    assert in_batch == alone

    other_seed = gen1(tiny, target, sampled(4321)).token_ids
    assert other_seed != alone
    assert_pool_whole(tiny.engine)


def test_unseeded_sampling_differs_between_runs(tiny):
    p = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    assert gen1(tiny, "Hi", p).token_ids != gen1(tiny, "Hi", p).token_ids
    assert_pool_whole(tiny.engine)


def test_n_returns_n_different_samples(tiny):
    (out,) = tiny.generate(["Tell me a story"], SamplingParams(temperature=0.8, top_p=0.9, n=3, max_tokens=12,
                                                               ignore_eos=True), use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 12 and c.finish_reason == "length" for c in out.outputs)
    assert len({c.text for c in out.outputs}) == 3
    assert_pool_whole(tiny.engine)


def test_seeded_n_is_reproducible(tiny):
    p = sampled(99, n=3)
    a = tiny.generate(["Tell me a story"], p, use_tqdm=False)[0]
    b = tiny.generate(["Tell me a story"], p, use_tqdm=False)[0]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({tuple(c.token_ids) for c in a.outputs}) == 3
    assert_pool_whole(tiny.engine)


def test_best_of_returns_the_n_with_highest_cumulative_logprob(tiny):
    prompt = tiny_prompts(1, seed=5)[0]
    # The i-th sample of a seeded request draws from its own stream, so n=4 shows all 4 candidates.
    (all4,) = tiny.generate([prompt], sampled(2024, n=4), use_tqdm=False)
    (best,) = tiny.generate([prompt], sampled(2024, n=2, best_of=4), use_tqdm=False)
    assert len(all4.outputs) == 4 and len(best.outputs) == 2
    assert [c.index for c in best.outputs] == [0, 1]
    ranked = sorted(all4.outputs, key=lambda c: c.cumulative_logprob, reverse=True)
    assert ranked[1].cumulative_logprob > ranked[2].cumulative_logprob  # a clear top 2
    assert {tuple(c.token_ids) for c in best.outputs} == {tuple(c.token_ids) for c in ranked[:2]}
    for c in best.outputs:
        assert c.cumulative_logprob >= ranked[1].cumulative_logprob - 1e-4
        assert c.finish_reason == "length"
    assert_pool_whole(tiny.engine)


# ---- the LLMEngine step loop ------------------------------------------------------------------
def test_engine_loop_add_step_abort(tiny):
    eng = tiny.engine
    prompts = tiny_prompts(3, seed=9)
    p = greedy(20, ignore_eos=True)
    for rid, prompt in zip("abc", prompts):
        assert eng.add_request(rid, prompt, p) == rid
    assert eng.has_unfinished_requests() and eng.get_num_unfinished_requests() == 3
    seen: dict[str, list] = {}
    for _ in range(4):
        for out in eng.step():
            seen.setdefault(out.request_id, []).append(out)
    assert set(seen) == {"a", "b", "c"}
    assert eng.kv.num_free_blocks < eng.kv.num_blocks

    eng.abort_request("b")
    assert eng.get_num_unfinished_requests() == 2
    n_before = len(seen["b"])
    rest = drain(eng)
    assert "b" not in rest, "an aborted request still produced output"
    assert len(seen["b"]) == n_before and not seen["b"][-1].finished
    for rid in "ac":
        final = rest[rid][-1]
        assert final.finished and len(final.outputs[0].token_ids) == 20
        assert all(not o.finished for o in rest[rid][:-1])
    assert not eng.has_unfinished_requests()
    assert eng.step() == []
    assert_pool_whole(eng)


def test_engine_abort_before_first_step_and_list_abort(tiny):
    eng = tiny.engine
    ids = [eng.add_request(None, pr, greedy(30)) for pr in tiny_prompts(3, seed=10)]
    assert len(set(ids)) == 3
    eng.abort_request(ids[0])  # still waiting
    eng.step()
    eng.abort_request(ids[1:])  # running, as a list
    assert not eng.has_unfinished_requests()
    assert eng.step() == []
    assert_pool_whole(eng)


def test_engine_rejects_duplicate_live_request_id(tiny):
    eng = tiny.engine
    from pagedcore import InvalidRequestError

    eng.add_request("dup", "Hello", greedy(5))
    with pytest.raises(InvalidRequestError) as e:
        eng.add_request("dup", "Hello again", greedy(5))
    assert e.value.field == "request_id"
    out = drain(eng)["dup"][-1]
    assert out.finished and out.prompt == "Hello" and len(out.outputs[0].token_ids) == 5
    eng.add_request("dup", "Hello", greedy(5))  # a finished id may be reused
    drain(eng)
    assert_pool_whole(eng)


def test_output_kinds_cumulative_delta_final_only(tiny):
    eng = tiny.engine
    prompt = tiny_prompts(1, seed=12)[0]
    p = greedy(24, ignore_eos=True, logprobs=1)
    eng.add_request("cum", prompt, p, output_kind=OutputKind.CUMULATIVE)
    eng.add_request("delta", prompt, p, output_kind=OutputKind.DELTA)
    eng.add_request("final", prompt, p, output_kind=OutputKind.FINAL_ONLY)
    outs = drain(eng)

    cum = outs["cum"]
    assert len(cum) == 24  # one per generated token
    for prev, cur in zip(cum, cum[1:]):
        assert cur.outputs[0].text.startswith(prev.outputs[0].text)
        assert cur.outputs[0].token_ids[:len(prev.outputs[0].token_ids)] == prev.outputs[0].token_ids
    assert [len(o.outputs[0].token_ids) for o in cum] == list(range(1, 25))
    final_cum = cum[-1].outputs[0]
    assert [o.finished for o in cum] == [False] * 23 + [True]

    deltas = outs["delta"]
    assert len(deltas) == 24 and deltas[-1].finished and not any(o.finished for o in deltas[:-1])
    assert "".join(o.outputs[0].text for o in deltas) == final_cum.text
    assert [t for o in deltas for t in o.outputs[0].token_ids] == final_cum.token_ids
    assert all(len(o.outputs[0].token_ids) == 1 for o in deltas)
    assert [d for o in deltas for d in o.outputs[0].logprobs] == final_cum.logprobs
    assert deltas[-1].outputs[0].finish_reason == "length"

    (final,) = outs["final"]
    assert final.finished
    assert final.outputs[0].text == final_cum.text and final.outputs[0].token_ids == final_cum.token_ids
    assert_pool_whole(eng)


def test_delta_stream_with_n_keeps_samples_apart(tiny):
    eng = tiny.engine
    p = sampled(5, n=2)
    eng.add_request("d", "Hello", p, output_kind=OutputKind.DELTA)
    eng.add_request("f", "Hello", p, output_kind=OutputKind.FINAL_ONLY)
    outs = drain(eng)
    (final,) = outs["f"]
    for i in range(2):
        parts = [c for o in outs["d"] for c in o.outputs if c.index == i]
        assert "".join(c.text for c in parts) == final.outputs[i].text
        assert [t for c in parts for t in c.token_ids] == final.outputs[i].token_ids
    assert_pool_whole(eng)


def test_streamed_deltas_equal_offline_text(smol, haiku, haiku_greedy):
    eng = smol.engine
    eng.add_request("s", haiku, greedy(24), output_kind=OutputKind.DELTA)
    deltas = drain(eng)["s"]
    assert "".join(o.outputs[0].text for o in deltas) == haiku_greedy.text
    assert [t for o in deltas for t in o.outputs[0].token_ids] == haiku_greedy.token_ids
    assert_pool_whole(eng)


def test_streamed_deltas_never_show_a_stop_string(smol, haiku, haiku_greedy):
    stop = "lapping of"
    full = haiku_greedy.text
    eng = smol.engine
    eng.add_request("s", haiku, greedy(24, stop=[stop]), output_kind=OutputKind.DELTA)
    deltas = drain(eng)["s"]
    texts = [o.outputs[0].text for o in deltas]
    assert "".join(texts) == full[:full.find(stop)]
    # deltas only ever append: the stop string's first pieces were withheld, never sent
    assert "lapping" not in "".join(texts)
    assert deltas[-1].finished and deltas[-1].outputs[0].stop_reason == stop
    assert_pool_whole(eng)

"""Bad input: a clear `InvalidRequestError` naming the field, for that request only; the engine
keeps serving everyone else and holds no block or queue entry for the rejected request."""

from __future__ import annotations

import pytest

from limits_helpers import drain
from pagedcore import LLM, InvalidRequestError, SamplingParams
from pagedcore.model_loader import ModelNotFoundError

BLOCK = 8
MAX_MODEL_LEN = 64
ENGINE = dict(block_size=BLOCK)
VOCAB = 49152  # the tiny model's


def greedy(max_tokens: int = 6) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def ids(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


def assert_clean(engine) -> None:
    assert engine.kv.num_free_blocks == engine.kv.num_blocks, "KV blocks leaked"
    assert not engine.requests, f"requests left: {list(engine.requests)}"
    assert not engine.scheduler.waiting and not engine.scheduler.running


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    """max_model_len (64) is the binding limit: the KV pool holds 16 * 8 = 128 tokens."""
    llm = LLM(str(tiny_model_dir("llama")), num_kv_blocks=16, max_model_len=MAX_MODEL_LEN, **ENGINE)
    yield llm
    assert_clean(llm.engine)


@pytest.fixture(scope="module")
def small_kv(tiny_model_dir):
    """The KV pool (4 * 8 = 32 tokens) is the binding limit: the model allows 512."""
    llm = LLM(str(tiny_model_dir("llama")), num_kv_blocks=4, **ENGINE)
    yield llm
    assert_clean(llm.engine)


def serve_around(engine, bad_call, field: str) -> InvalidRequestError:
    """A good request is mid-generation when `bad_call` is rejected; it finishes untouched,
    and a good request added afterwards is served too."""
    engine.add_request("bystander", ids(10), greedy(12))
    engine.step()
    engine.step()
    used = engine.kv.num_blocks - engine.kv.num_free_blocks
    with pytest.raises(InvalidRequestError) as e:
        bad_call()
    assert e.value.field == field, f"field {e.value.field!r}, message: {e.value}"
    assert str(e.value)
    # nothing of the bad request was admitted
    assert list(engine.requests) == ["bystander"]
    assert engine.kv.num_blocks - engine.kv.num_free_blocks == used
    engine.add_request("after", ids(5, start=900), greedy(4))
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert set(done) == {"bystander", "after"}
    assert len(done["bystander"].outputs[0].token_ids) == 12
    assert len(done["after"].outputs[0].token_ids) == 4
    assert_clean(engine)
    return e.value


# (case name, prompt, params, field). Params are dicts: they reach the engine as user JSON would.
BAD = [
    ("empty string", "", None, "prompt"),
    ("empty token list", [], None, "prompt"),
    ("token id = vocab size", [5, VOCAB, 7], None, "prompt"),
    ("negative token id", [5, -1], None, "prompt"),
    ("prompt neither str nor ids", 3.14, None, "prompt"),
    ("mixed list", [1, "two", 3], None, "prompt"),
    ("negative temperature", "Hello", {"temperature": -0.5}, "temperature"),
    ("top_p 0", "Hello", {"top_p": 0}, "top_p"),
    ("top_p 1.5", "Hello", {"top_p": 1.5}, "top_p"),
    ("top_k -5", "Hello", {"top_k": -5}, "top_k"),
    ("n 0", "Hello", {"n": 0}, "n"),
    ("best_of < n", "Hello", {"n": 3, "best_of": 2}, "best_of"),
    ("min_tokens > max_tokens", "Hello", {"min_tokens": 10, "max_tokens": 5}, "min_tokens"),
    ("max_tokens 0", "Hello", {"max_tokens": 0}, "max_tokens"),
    ("temperature not a number", "Hello", {"temperature": "hot"}, "temperature"),
    ("logprobs too many", "Hello", {"logprobs": 1000}, "logprobs"),
    ("stop token outside vocab", "Hello", {"stop_token_ids": [VOCAB + 3]}, "stop_token_ids"),
    ("unknown field", "Hello", {"temprature": 1}, "temprature"),
    ("params not a dict", "Hello", "greedy please", "sampling_params"),
    ("params a list", "Hello", [("temperature", 0)], "sampling_params"),
]


@pytest.mark.parametrize("prompt,params,field", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_request_is_rejected_naming_the_field_and_others_are_served(llm, prompt, params, field):
    eng = llm.engine
    serve_around(eng, lambda: eng.add_request("bad", prompt, params), field)


def test_prompt_longer_than_max_model_len(llm):
    eng = llm.engine
    err = serve_around(eng, lambda: eng.add_request("bad", ids(MAX_MODEL_LEN + 6), greedy()), "prompt")
    assert str(MAX_MODEL_LEN + 6) in str(err) and str(MAX_MODEL_LEN) in str(err)


def test_prompt_longer_than_the_whole_kv_budget(small_kv):
    eng = small_kv.engine
    assert eng.max_model_len > 40
    with pytest.raises(InvalidRequestError) as e:
        eng.add_request("bad", ids(40), greedy())
    assert e.value.field == "prompt"
    assert "40" in str(e.value) and "32" in str(e.value)  # the prompt's length, the KV budget
    assert_clean(eng)
    # and the engine still serves what fits
    (out,) = small_kv.generate([ids(10)], greedy(5), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 5
    assert_clean(eng)


@pytest.mark.parametrize("engine_fixture,capacity", [("llm", MAX_MODEL_LEN), ("small_kv", 4 * BLOCK)])
def test_prompt_at_the_limit_gets_one_token(request, engine_fixture, capacity):
    """capacity - 1 prompt tokens fit and leave room for exactly one new token; capacity do not."""
    llm = request.getfixturevalue(engine_fixture)
    (out,) = llm.generate([ids(capacity - 1)], greedy(50), use_tqdm=False)
    assert out.outputs[0].token_ids and len(out.outputs[0].token_ids) == 1
    assert out.outputs[0].finish_reason == "length"
    with pytest.raises(InvalidRequestError):
        llm.generate([ids(capacity)], greedy(50), use_tqdm=False)
    assert_clean(llm.engine)


def test_long_generation_is_capped_by_the_kv_budget_not_stuck(small_kv):
    """Two requests that each grow to the whole pool: preempted in turn, both finish at capacity."""
    outs = small_kv.generate([ids(10), ids(12, start=500)], SamplingParams(temperature=0, max_tokens=None,
                                                                          ignore_eos=True), use_tqdm=False)
    for o, n_prompt in zip(outs, (10, 12)):
        assert o.outputs[0].finish_reason == "length"
        assert n_prompt + len(o.outputs[0].token_ids) == 4 * BLOCK
    assert_clean(small_kv.engine)


@pytest.mark.parametrize("kwargs,field", [
    (dict(temperature=-1), "temperature"),
    (dict(top_p=0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-5), "top_k"),
    (dict(n=0), "n"),
    (dict(n=2, best_of=1), "best_of"),
    (dict(min_tokens=9, max_tokens=3), "min_tokens"),
    (dict(stop=[""]), "stop"),
    (dict(stop_token_ids=[-2]), "stop_token_ids"),
    (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(min_p=2), "min_p"),
])
def test_sampling_params_constructor_names_the_field(kwargs, field):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kwargs)
    assert e.value.field == field
    assert field in str(e.value)
    assert isinstance(e.value, ValueError)


def test_from_dict_unknown_field_is_named():
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams.from_dict({"temprature": 1})
    assert e.value.field == "temprature"
    assert "temprature" in str(e.value)


def test_from_dict_rejects_non_dict():
    for bad in (None, [1, 2], "temperature=0", 3):
        with pytest.raises(InvalidRequestError) as e:
            SamplingParams.from_dict(bad)
        assert e.value.field == "sampling_params"


def test_from_dict_accepts_good_json():
    p = SamplingParams.from_dict({"temperature": 0, "max_tokens": 3, "stop": "x"})
    assert p.greedy and p.max_tokens == 3 and p.stop == ["x"]


def test_bad_prompt_in_the_middle_of_generate_queues_nothing(llm):
    eng = llm.engine
    prompts = [ids(5), ids(6, start=300), [], ids(7, start=600)]
    with pytest.raises(InvalidRequestError) as e:
        llm.generate(prompts, greedy(), use_tqdm=False)
    assert e.value.field == "prompt"
    assert_clean(eng)
    # bad params in the middle of a params list: same
    params = [greedy(), greedy(), {"top_k": -5}, greedy()]
    with pytest.raises(InvalidRequestError) as e:
        llm.generate([ids(5), ids(6), ids(7), ids(8)], params, use_tqdm=False)
    assert e.value.field == "top_k"
    assert_clean(eng)
    # the good prompts alone are served
    outs = llm.generate([p for p in prompts if p], greedy(), use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [p for p in prompts if p]
    assert all(len(o.outputs[0].token_ids) == 6 for o in outs)
    assert_clean(eng)


def test_generate_with_mismatched_params_list(llm):
    with pytest.raises(ValueError):
        llm.generate([ids(5), ids(6)], [greedy()], use_tqdm=False)
    assert_clean(llm.engine)


def test_aborting_an_unknown_id_is_a_no_op(llm):
    eng = llm.engine
    eng.add_request("live", ids(5), greedy(8))
    eng.abort_request("no-such-request")
    eng.abort_request(["nope", "nope-2"])
    assert list(eng.requests) == ["live"]
    while eng.has_unfinished_requests():
        outs = eng.step()
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 8
    eng.abort_request("live")  # finished: also a no-op
    assert_clean(eng)


def test_unknown_model_path_is_a_clear_error():
    with pytest.raises(ModelNotFoundError) as e:
        LLM("/nonexistent", num_kv_blocks=4)
    assert "/nonexistent" in str(e.value)
    assert isinstance(e.value, FileNotFoundError)


def test_directory_without_a_model_is_a_clear_error(tmp_path):
    with pytest.raises(ModelNotFoundError) as e:
        LLM(str(tmp_path), num_kv_blocks=4)
    assert str(tmp_path) in str(e.value)


@pytest.fixture(scope="module")
def unchunked(tiny_model_dir):
    """Without chunked prefill a sequence's (re)prefill must fit one step's 16-token budget;
    the KV pool (5 * 8 = 40 tokens) forces preemption of three growing sequences."""
    llm = LLM(str(tiny_model_dir("llama")), num_kv_blocks=5, enable_chunked_prefill=False,
              max_num_batched_tokens=16, **ENGINE)
    yield llm
    assert_clean(llm.engine)


def test_prompt_longer_than_one_step_without_chunked_prefill_is_rejected(unchunked):
    """Otherwise it would wait forever (and block every request behind it)."""
    eng = unchunked.engine
    with pytest.raises(InvalidRequestError) as e:
        eng.add_request("bad", ids(20), greedy())
    assert e.value.field == "prompt" and "16" in str(e.value)
    assert_clean(eng)
    eng.add_request("ok", ids(6), greedy(4))
    assert len(drain(eng, 400)["ok"].outputs[0].token_ids) == 4
    assert_clean(eng)


def test_preempted_sequences_resume_without_chunked_prefill(unchunked):
    eng = unchunked.engine
    for rid, n in zip("abc", (6, 7, 5)):
        eng.add_request(rid, ids(n, start=100 * n), SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))
    done = drain(eng, 400)
    assert set(done) == {"a", "b", "c"}
    assert all(o.outputs[0].finish_reason == "length" for o in done.values())
    assert eng.scheduler.num_preemptions > 0
    assert_clean(eng)

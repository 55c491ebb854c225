"""The LLMEngine step loop (add_request / step / abort_request) and the output kinds it streams.

Engines: conftest.py (the tiny random-weight Llama; SmolLM2 where the streamed text must mean something).
"""

from __future__ import annotations

import pytest

from api_helpers import assert_pool_whole, drain, greedy, sampled, tiny_prompts
from pagedcore import OutputKind


# ---- the LLMEngine step loop ------------------------------------------------------------------
def test_engine_loop_add_step_abort(tiny):
    eng = tiny.engine
    prompts = tiny_prompts(3, seed=9)
    p = greedy(60, ignore_eos=True)  # unfinished after 4 steps even of 8 forwards each (num_scheduler_steps)
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
        assert final.finished and len(final.outputs[0].token_ids) == 60
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

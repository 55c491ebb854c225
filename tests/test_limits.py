"""Issue 15: limits, deadlines and fault isolation, in the engine (tiny Llama, CPU); shutdown: test_shutdown.py.

Every refusal names the field and the setting, is counted by reason, leaves no block or queue entry
behind, and never disturbs the requests around it. A step that raises fails only its own requests;
the requests after it produce exactly what a clean engine produces.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from limits_helpers import (ENGINE, LONG, TIMEOUT, aborted, assert_clean, drain, greedy, ids,  # noqa: F401
                            model, rejected, run)
from pagedcore import InvalidRequestError, SamplingParams, hookimpl
from pagedcore.async_engine import AsyncLLMEngine
from pagedcore.limits import (EngineDeadError, LimitExceededError, OverloadedError, RequestFailedError,
                              RequestTimeoutError)
from pagedcore.llm_engine import LLMEngine


class Pace:
    """A logits processor that makes every step take at least `seconds`: the deadline tests' requests run
    to the 512-token context in >= 2.5 s however fast the machine (CI once ran one to its end inside 0.4 s)."""

    def __init__(self, seconds: float = 0.005):
        self.seconds = seconds

    @hookimpl
    def pagedcore_logits_processors(self, config):
        return [self.process]

    def process(self, logits, seqs):
        time.sleep(self.seconds)
        return logits


@pytest.fixture(scope="module")
def limited(model):
    engine = LLMEngine(model=model, max_input_tokens=20, max_total_tokens=40, **ENGINE)
    yield engine
    assert_clean(engine)


# ---- item 3: every per-request resource is bounded ---------------------------------------------------------
OVER = {  # name: (prompt, params, field, setting)
    "n 100000": (ids(5), {"n": 100000}, "n", "max_best_of"),
    "best_of 17": (ids(5), {"n": 1, "best_of": 17}, "best_of", "max_best_of"),
    "beam width 17": (ids(5), {"use_beam_search": True, "n": 2, "best_of": 17}, "best_of", "max_best_of"),
    "17 stop strings": (ids(5), {"stop": [f"s{i}" for i in range(17)]}, "stop", "max_stop_sequences"),
    "17 stop token ids": (ids(5), {"stop_token_ids": list(range(17))}, "stop_token_ids", "max_stop_sequences"),
    "prompt over payload_limit": ("x" * 2_000_001, None, "prompt", "payload_limit"),
    "prompt over max_input_tokens": (ids(21), None, "prompt", "max_input_tokens"),
    "max_tokens over max_total_tokens": (ids(15), {"max_tokens": 26}, "max_tokens", "max_total_tokens"),
}


@pytest.mark.parametrize("case", list(OVER))
def test_a_request_over_a_limit_is_refused_at_once_and_counted_and_others_go_on(limited, case):
    prompt, params, field, setting = OVER[case]
    limited.add_request("bystander", ids(10, start=700), greedy(8))
    limited.step()
    before = rejected(limited)
    t0 = time.monotonic()
    with pytest.raises(LimitExceededError) as e:
        limited.add_request("bad", prompt, params)
    assert time.monotonic() - t0 < 1.0, "refused only after doing the work"
    assert (e.value.field, e.value.setting) == (field, setting)
    assert isinstance(e.value, InvalidRequestError) and setting in str(e.value)
    after = rejected(limited)
    assert after[setting] == before[setting] + 1 and sum(after.values()) == sum(before.values()) + 1
    assert list(limited.requests) == ["bystander"]
    done = drain(limited)
    assert len(done["bystander"].outputs[0].token_ids) == 8
    assert_clean(limited)


def test_at_the_limits_requests_are_served(limited):
    limited.add_request("input", ids(20), greedy(20))  # 20 + 20 = max_total_tokens
    limited.add_request("capped", ids(18), SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))
    limited.add_request("width", ids(5), SamplingParams(n=16, temperature=0.8, max_tokens=2, seed=1,
                                                        stop=[f"s{i}" for i in range(16)]))
    done = drain(limited)
    assert len(done["input"].outputs[0].token_ids) == 20
    # no max_tokens: capped to max_total_tokens, finish "length"
    assert len(done["capped"].outputs[0].token_ids) == 22 and done["capped"].outputs[0].finish_reason == "length"
    assert len(done["width"].outputs) == 16
    assert_clean(limited)


# ---- item 1: admission control ---------------------------------------------------------------------------
def test_max_concurrent_requests_refuses_the_next_one_at_once_until_one_finishes(model):
    aeng = AsyncLLMEngine(LLMEngine(model=model, max_concurrent_requests=2, **ENGINE))

    async def main():
        a, b = aeng.generate(ids(8), LONG), aeng.generate(ids(8, start=300), LONG)
        await a.__anext__(), await b.__anext__()
        t0 = time.monotonic()
        with pytest.raises(OverloadedError) as e:
            await aeng.generate(ids(8, start=600), greedy(4)).__anext__()
        assert time.monotonic() - t0 < 0.5 and e.value.reason == "max_concurrent_requests"
        assert e.value.retry_after > 0 and "max_concurrent_requests" in str(e.value)
        await a.aclose()  # one leaves: there is room again
        outs = [o async for o in aeng.generate(ids(8, start=600), greedy(4))]
        assert outs[-1].finished and not outs[-1].error
        await b.aclose()

    try:
        run(main())
        assert aeng.wait_idle(TIMEOUT)
        assert rejected(aeng.engine)["max_concurrent_requests"] == 1
        assert aborted(aeng.engine)["client"] == 2
        assert_clean(aeng.engine)
    finally:
        aeng.shutdown()


def test_default_max_concurrent_requests_is_sized_from_the_kv_cache(model):
    engine = LLMEngine(model=model, **ENGINE)
    assert engine.max_concurrent_requests == max(engine.config.max_num_seqs, engine.kv.num_blocks) == 128
    engine = LLMEngine(model=model, **{**ENGINE, "num_kv_blocks": 1000})
    assert engine.max_concurrent_requests == 1000


def test_a_request_waiting_past_max_waiting_time_is_refused_as_overload(model):
    # Paced: the running request must hold the only row past 0.3 s (CI once ran it to the 512-token context inside it).
    engine = LLMEngine(model=model, max_num_seqs=1, max_waiting_time=0.3, plugins=[Pace()], **ENGINE)
    engine.add_request("running", ids(8), SamplingParams(**LONG))
    engine.add_request("waiting", ids(8, start=300), greedy(4))
    t0, ended = time.monotonic(), None
    while ended is None:
        assert time.monotonic() - t0 < 10, "the waiting request was never refused"
        ended = next((o for o in engine.step() if o.request_id == "waiting"), None)
    assert isinstance(ended.error, OverloadedError) and ended.error.reason == "max_waiting_time"
    assert ended.finished and time.monotonic() - t0 >= 0.3
    assert rejected(engine)["max_waiting_time"] == 1
    assert list(engine.requests) == ["running"]  # the running one goes on
    engine.abort_request("running")
    assert_clean(engine)


# ---- item 2: deadlines ---------------------------------------------------------------------------------------
def test_a_request_past_its_timeout_is_aborted_with_its_blocks_freed(model):
    aeng = AsyncLLMEngine(LLMEngine(model=model, plugins=[Pace()], **ENGINE))

    async def main():
        t0 = time.monotonic()
        with pytest.raises(RequestTimeoutError, match="timeout"):
            async for _ in aeng.generate(ids(8), LONG, timeout=0.3):
                pass
        assert 0.3 <= time.monotonic() - t0 < 5
        outs = [o async for o in aeng.generate(ids(8, start=300), greedy(4), timeout=30)]  # in time: unaffected
        assert outs[-1].finished and sum(len(o.outputs[0].token_ids) for o in outs) == 4

    try:
        run(main())
        assert aeng.wait_idle(TIMEOUT)
        assert aborted(aeng.engine)["timeout"] == 1
        assert_clean(aeng.engine)
    finally:
        aeng.shutdown()


def test_request_timeout_setting_is_the_default_deadline_and_a_shorter_own_one_wins(model):
    engine = LLMEngine(model=model, request_timeout=0.4, plugins=[Pace()], **ENGINE)
    engine.add_request("default", ids(8), SamplingParams(**LONG))
    engine.add_request("own", ids(8, start=300), SamplingParams(**LONG), timeout=0.1)
    engine.add_request("longer", ids(8, start=600), SamplingParams(**LONG), timeout=100)  # the setting caps it
    t0, ended = time.monotonic(), {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                ended[out.request_id] = (out, time.monotonic() - t0)
        assert time.monotonic() - t0 < 10
    assert all(isinstance(out.error, RequestTimeoutError) and out.outputs == [] for out, _ in ended.values())
    assert ended["own"][1] < ended["default"][1]
    assert 0.4 <= ended["default"][1] < 3 and 0.4 <= ended["longer"][1] < 3
    assert aborted(engine)["timeout"] == 3
    assert_clean(engine)


# ---- item 4: fault isolation ------------------------------------------------------------------------------------
class RaiseOnCall:
    """A plugin whose logits processor raises on its Nth call (every call from the Nth if `every`)."""

    def __init__(self, n: int, every: bool = False):
        self.n, self.every, self.calls = n, every, 0

    @hookimpl
    def pagedcore_logits_processors(self, config):
        return [self.process]

    def process(self, logits, seqs):
        self.calls += 1
        if self.calls == self.n or (self.every and self.calls >= self.n):
            raise ValueError(f"injected plugin failure at call {self.calls}")
        return logits


def break_layer_forward(engine, n: int) -> None:
    """Make the model's second decoder layer raise on its Nth call: the first layer has written
    this step's KV by then, as with a kernel error mid-forward."""
    layer = engine.model.model.layers[1]
    forward, calls = layer.forward, [0]

    def failing(*args, **kwargs):
        calls[0] += 1
        if calls[0] == n:
            raise RuntimeError("injected kernel error in the model runner")
        return forward(*args, **kwargs)

    layer.forward = failing


CASES = {"A": ids(12), "B": ids(11, start=400), "W": ids(9, start=900), "C": ids(10, start=1500),
         "D": ids(13, start=2000)}


def texts(outs) -> dict[str, list[int]]:
    return {rid: out.outputs[0].token_ids for rid, out in outs.items()}


@pytest.fixture(scope="module")
def clean(model):
    """What a clean engine produces: W alone, C and D together, A alone (the failed prompt again)."""
    engine = LLMEngine(model=model, max_num_seqs=2, **ENGINE)
    ref = {}
    for group in (["W"], ["C", "D"], ["A"]):
        for rid in group:
            engine.add_request(rid, CASES[rid], greedy(10))
        ref.update(texts(drain(engine)))
    return ref


@pytest.mark.parametrize("fault", ["logits processor plugin", "model runner"])
def test_a_failed_step_fails_only_its_requests_and_the_rest_equal_a_clean_run(model, clean, fault):
    plugin = RaiseOnCall(3)
    engine = LLMEngine(model=model, max_num_seqs=2, plugins=[plugin] if "plugin" in fault else [], **ENGINE)
    if fault == "model runner":
        break_layer_forward(engine, 3)
    for rid in ("A", "B", "W"):  # max_num_seqs 2: W waits while A and B run
        engine.add_request(rid, CASES[rid], greedy(10))
    failed = {}
    for _ in range(3):
        failed.update({o.request_id: o for o in engine.step() if o.finished})
    assert set(failed) == {"A", "B"}, "the third step must fail A and B, and only them"
    for out in failed.values():
        assert isinstance(out.error, RequestFailedError) and "injected" in str(out.error) and out.outputs == []
    assert engine.num_step_failures == 1 and engine.healthy and aborted(engine)["error"] == 2
    assert list(engine.requests) == ["W"]
    assert engine.kv.num_free_blocks == engine.kv.num_blocks and not engine.scheduler.running  # W not started
    # recovery: the waiting request, then new ones, then the failed prompt again, exactly as a clean engine
    got = texts(drain(engine))
    for rid in ("C", "D"):
        engine.add_request(rid, CASES[rid], greedy(10))
    got.update(texts(drain(engine)))
    engine.add_request("A", CASES["A"], greedy(10))
    got.update(texts(drain(engine)))
    assert got == clean
    assert engine.consecutive_step_failures == 0 and engine.healthy
    assert_clean(engine)


def test_repeated_step_failures_mark_the_engine_unhealthy_instead_of_spinning(model):
    engine = LLMEngine(model=model, max_consecutive_step_failures=3, plugins=[RaiseOnCall(1, every=True)], **ENGINE)
    for i in range(3):
        assert engine.healthy
        engine.add_request(f"r{i}", ids(8, start=100 * i), greedy(4))
        (out,) = engine.step()
        assert isinstance(out.error, RequestFailedError)
    assert not engine.healthy and engine.num_step_failures == 3
    with pytest.raises(EngineDeadError, match="unhealthy"):
        engine.add_request("next", ids(8), greedy(4))
    assert rejected(engine)["unavailable"] == 1
    aeng = AsyncLLMEngine(engine)  # what /readyz reads
    try:
        assert not aeng.healthy
    finally:
        aeng.shutdown()
    assert_clean(engine)


def test_async_a_failed_step_raises_in_its_streams_only_and_the_engine_serves_on(model, clean):
    plugin = RaiseOnCall(3)
    aeng = AsyncLLMEngine(LLMEngine(model=model, max_num_seqs=2, plugins=[plugin], **ENGINE))

    async def tokens(rid):
        return [t async for out in aeng.generate(CASES[rid], greedy(10), request_id=rid)
                for t in out.outputs[0].token_ids]

    async def main():
        results = await asyncio.gather(*(tokens(r) for r in ("A", "B", "W")), return_exceptions=True)
        assert all(isinstance(r, RequestFailedError) for r in results[:2]), results
        assert results[2] == clean["W"]
        assert await asyncio.gather(tokens("C"), tokens("D")) == [clean["C"], clean["D"]]

    try:
        run(main())
        assert aeng.healthy and aeng.wait_idle(TIMEOUT)
        assert_clean(aeng.engine)
    finally:
        aeng.shutdown()

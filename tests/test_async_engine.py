"""AsyncLLMEngine: many coroutines stream from one engine thread; cancelling or leaving a stream
aborts its request; bad input fails in the caller; shutdown ends the thread (tiny Llama, CPU)."""

from __future__ import annotations

import asyncio
import contextlib
import threading

import pytest
import torch

from pagedcore import LLM, InvalidRequestError, OutputKind, SamplingParams, hookimpl
from pagedcore.async_engine import AsyncLLMEngine, EngineDeadError
from pagedcore.llm_engine import LLMEngine

ENGINE = dict(num_kv_blocks=96, block_size=8)
TIMEOUT = 60  # seconds: a hang fails the test instead of the run


class EventRecorder:
    def __init__(self):
        self.events: list[tuple[str, str | None]] = []

    @hookimpl
    def pagedcore_request_event(self, event, request_id, seq_index, info):
        self.events.append((event, request_id))

    def of(self, request_id: str) -> set[str]:
        return {e for e, rid in list(self.events) if rid == request_id}


def greedy(max_tokens, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=2, **kw)


LONG = dict(temperature=0.0, max_tokens=None, ignore_eos=True)  # runs to the 512-token context


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT))


def assert_pool_whole(engine) -> None:
    assert engine.kv.num_free_blocks == engine.kv.num_blocks, "KV blocks leaked"
    assert not engine.requests, f"requests left: {list(engine.requests)}"


def assert_same_greedy(ours, ref, tol=1e-4) -> None:
    """Token for token, unless a step is a near-tie (the two engines then ran different batches)."""
    for t, (a, b) in enumerate(zip(ref.token_ids, ours.token_ids)):
        if a != b:
            gap_ref = abs(ref.logprobs[t][a].logprob - ref.logprobs[t][b].logprob) if b in ref.logprobs[t] else 1
            gap_ours = abs(ours.logprobs[t][a].logprob - ours.logprobs[t][b].logprob) if a in ours.logprobs[t] else 1
            assert gap_ref < tol and gap_ours < tol, f"step {t}: {a} vs {b}, not a near-tie"
            return
    assert ours.token_ids == ref.token_ids
    assert ours.text == ref.text


async def collect(aeng, prompt, params, **kw):
    """Concatenate a stream of deltas into (text, token ids, logprobs, last output, count)."""
    text, ids, lps, n, last = "", [], [], 0, None
    async for out in aeng.generate(prompt, params, **kw):
        assert last is None or not last.finished
        (c,) = out.outputs
        text += c.text
        ids += c.token_ids
        lps += c.logprobs or []
        n, last = n + 1, out
    assert last is not None and last.finished
    return Streamed(text, ids, lps, last, n)


class Streamed:
    def __init__(self, text, token_ids, logprobs, last, count):
        self.text, self.token_ids, self.logprobs, self.last, self.count = text, token_ids, logprobs, last, count


# ---- the shared engine: offline references first, then the async engine over it -----------------
@pytest.fixture(scope="module")
def recorder():
    return EventRecorder()


@pytest.fixture(scope="module")
def llm(tiny_model_dir, recorder):
    return LLM(str(tiny_model_dir("llama")), plugins=[recorder], **ENGINE)


@pytest.fixture(scope="module")
def cases(llm):
    """16 prompts of mixed lengths (ids and strings) and mixed max_tokens; their offline outputs."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 49152, (int(n),), generator=g).tolist() for n in torch.randint(2, 45, (12,), generator=g)]
    prompts += ["Hello, my name is", "The capital of France is", "1, 2, 3,", "Once upon a time, in a land"]
    max_tokens = [1, 2, 3, 5, 8, 13, 21, 34, 40, 7, 16, 25, 4, 30, 11, 19]
    params = [greedy(m) for m in max_tokens]
    offline = llm.generate(prompts, params, use_tqdm=False)
    long_ref = llm.generate([prompts[0]], greedy(200, ignore_eos=True), use_tqdm=False)[0]
    assert_pool_whole(llm.engine)
    return prompts, params, [o.outputs[0] for o in offline], long_ref.outputs[0]


@pytest.fixture(scope="module")
def aeng(llm, cases):
    a = AsyncLLMEngine(llm.engine)
    yield a
    a.shutdown()
    assert not a._thread.is_alive()


# ---- streaming ---------------------------------------------------------------------------------
def test_sixteen_concurrent_streams_equal_offline_greedy(aeng, cases):
    prompts, params, offline, _ = cases

    async def main():
        return await asyncio.gather(*(collect(aeng, p, sp) for p, sp in zip(prompts, params)))

    streamed = run(main())
    for s, ref, sp in zip(streamed, offline, params):
        assert s.last.outputs[0].finish_reason == ref.finish_reason
        assert s.count == len(s.token_ids)  # one delta per token
        assert len(s.token_ids) == len(ref.token_ids) <= sp.max_tokens
        assert_same_greedy(s, ref)
    assert aeng.wait_idle(TIMEOUT)
    assert_pool_whole(aeng.engine)


def test_cumulative_output_kind_streams_whole_text(aeng, cases):
    prompts, params, offline, _ = cases

    async def main():
        return [o async for o in aeng.generate(prompts[7], params[7], output_kind=OutputKind.CUMULATIVE)]

    outs = run(main())
    assert outs[-1].finished and len(outs) == len(offline[7].token_ids)
    assert_same_greedy(outs[-1].outputs[0], offline[7])
    assert aeng.wait_idle(TIMEOUT)
    assert_pool_whole(aeng.engine)


def test_cancelled_and_abandoned_streams_are_aborted_and_free_their_blocks(aeng, cases, recorder):
    prompts, params, offline, _ = cases

    async def main():
        got_two = {i: asyncio.Event() for i in range(3)}

        async def to_be_cancelled(i):
            n = 0
            async for _ in aeng.generate(prompts[i], LONG, request_id=f"cancel-{i}"):
                n += 1
                if n == 2:
                    got_two[i].set()
            raise AssertionError("a stream to be cancelled ran to its end")

        async def leaves_early(i):  # `break`: the generator is dropped unfinished
            n = 0
            async for _ in aeng.generate(prompts[i], LONG, request_id=f"break-{i}"):
                n += 1
                if n == 3:
                    break
            return n

        async def closes_early(i):  # explicit aclose(), as `async with aclosing(...)` does
            async with contextlib.aclosing(aeng.generate(prompts[i], LONG, request_id=f"close-{i}")) as stream:
                async for _ in stream:
                    break
            return 1

        cancel = [asyncio.create_task(to_be_cancelled(i)) for i in range(3)]
        others = asyncio.gather(*(leaves_early(i) for i in range(3, 6)), *(closes_early(i) for i in range(6, 8)),
                                *(collect(aeng, prompts[i], params[i]) for i in range(8, 12)))
        await asyncio.gather(*(e.wait() for e in got_two.values()))
        for t in cancel:
            t.cancel()
        results = await asyncio.gather(*cancel, return_exceptions=True)
        assert all(isinstance(r, asyncio.CancelledError) for r in results), results
        done = await others
        # wait in a thread: the loop must keep running to finalise the dropped generators
        assert await asyncio.to_thread(aeng.wait_idle, TIMEOUT)
        return done

    done = run(main())
    assert done[:3] == [3, 3, 3] and done[3:5] == [1, 1]
    for s, i in zip(done[5:], range(8, 12)):
        assert_same_greedy(s, offline[i])
    for rid in [f"cancel-{i}" for i in range(3)] + [f"break-{i}" for i in range(3, 6)] + ["close-6", "close-7"]:
        assert recorder.of(rid) >= {"added", "aborted"}, (rid, recorder.of(rid))
        assert "finished" not in recorder.of(rid), f"{rid} ran to its end instead of being aborted"
    assert_pool_whole(aeng.engine)

    # the engine still serves a new request, correctly
    s = run(collect(aeng, prompts[12], params[12]))
    assert_same_greedy(s, offline[12])
    assert aeng.wait_idle(TIMEOUT)
    assert_pool_whole(aeng.engine)


def test_abort_by_id_ends_the_request(aeng, cases, recorder):
    prompts, _, _, _ = cases

    async def main():
        stream = aeng.generate(prompts[1], LONG, request_id="by-id")
        await stream.__anext__()
        aeng.abort("by-id")
        await stream.aclose()
        assert await asyncio.to_thread(aeng.wait_idle, TIMEOUT)

    run(main())
    assert "aborted" in recorder.of("by-id") and "finished" not in recorder.of("by-id")
    assert_pool_whole(aeng.engine)


BAD = [
    ("Hello", {"temperature": -1}, "temperature"),
    ("Hello", {"top_p": 1.5}, "top_p"),
    ("Hello", {"temprature": 0}, "temprature"),
    ("Hello", "not params", "sampling_params"),
    ("", None, "prompt"),
    ([], None, "prompt"),
    ([1, 49152], None, "prompt"),
    (list(range(3, 600)), None, "prompt"),  # longer than the 512-token context
]


def test_invalid_request_raises_in_the_caller_before_any_output(aeng, cases):
    prompts, params, offline, _ = cases

    async def main():
        good = asyncio.create_task(collect(aeng, prompts[9], params[9]))
        for prompt, sp, field in BAD:
            outputs = []
            with pytest.raises(InvalidRequestError) as e:
                async for out in aeng.generate(prompt, sp):
                    outputs.append(out)
            assert e.value.field == field
            assert outputs == []
        return await good

    s = run(main())
    assert_same_greedy(s, offline[9])  # the good request was not disturbed
    assert aeng.wait_idle(TIMEOUT)
    assert_pool_whole(aeng.engine)


def test_duplicate_request_id_is_rejected_and_the_first_goes_on(aeng, cases):
    prompts, _, _, long_ref = cases

    async def main():
        first = aeng.generate(prompts[0], greedy(200, ignore_eos=True), request_id="same")
        head = await first.__anext__()
        with pytest.raises(InvalidRequestError) as e:
            async for _ in aeng.generate(prompts[5], greedy(5), request_id="same"):
                pass
        assert e.value.field == "request_id"
        rest = [o async for o in first]
        return [head] + rest

    outs = run(main())
    assert all(o.request_id == "same" for o in outs) and outs[-1].finished
    assert [t for o in outs for t in o.outputs[0].token_ids] == long_ref.token_ids
    assert "".join(o.outputs[0].text for o in outs) == long_ref.text
    assert aeng.wait_idle(TIMEOUT)
    assert_pool_whole(aeng.engine)


def test_coroutines_on_two_event_loops_in_two_threads(aeng, cases):
    prompts, params, offline, _ = cases
    results: dict[int, object] = {}
    errors = []

    def worker(idxs):
        try:
            async def main():
                return await asyncio.gather(*(collect(aeng, prompts[i], params[i]) for i in idxs))
            for i, s in zip(idxs, run(main())):
                results[i] = s
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(idxs,)) for idxs in ([2, 4, 6], [3, 5, 13])]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert not errors, errors
    assert sorted(results) == [2, 3, 4, 5, 6, 13]
    for i, s in results.items():
        assert_same_greedy(s, offline[i])
    assert aeng.wait_idle(TIMEOUT)
    assert_pool_whole(aeng.engine)


def test_a_caller_whose_event_loop_closed_does_not_kill_the_engine(aeng, cases, recorder):
    """A caller's loop closes while its request is mid-stream (its generator never finalised):
    the engine thread must survive delivering to it, and go on serving everyone else."""
    prompts, params, offline, _ = cases
    loop = asyncio.new_event_loop()
    stranded = aeng.generate(prompts[2], LONG, request_id="stranded")
    loop.run_until_complete(stranded.__anext__())
    loop.close()

    s = run(collect(aeng, prompts[14], params[14]))
    assert_same_greedy(s, offline[14])
    assert aeng.wait_idle(TIMEOUT)
    assert aeng._thread.is_alive()
    assert "aborted" in recorder.of("stranded")  # nobody can read it: its request is dropped
    assert_pool_whole(aeng.engine)
    del stranded


# ---- shutdown ----------------------------------------------------------------------------------
def test_shutdown_stops_the_thread_and_ends_streams_in_flight(tiny_model_dir):
    engine = LLMEngine(model=str(tiny_model_dir("llama")), **ENGINE)
    aeng = AsyncLLMEngine(engine)
    assert aeng._thread.is_alive()

    async def main():
        s = await collect(aeng, "Hello", greedy(3))
        assert len(s.token_ids) == 3
        in_flight = aeng.generate([5, 6, 7], LONG)
        await in_flight.__anext__()
        await asyncio.to_thread(aeng.shutdown)
        assert not aeng._thread.is_alive()
        # the caller still streaming is told, not left waiting forever
        with pytest.raises(EngineDeadError):
            async for _ in in_flight:
                pass
        with pytest.raises(EngineDeadError):
            await aeng.generate("Hello", greedy(3)).__anext__()

    run(main())
    assert not aeng._thread.is_alive()
    assert_pool_whole(engine)

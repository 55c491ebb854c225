"""Issue 15, item 4: graceful shutdown of the async engine (tiny Llama, CPU): admission stops at once, requests in
flight finish within the grace period or are aborted past it, and nothing is left behind."""

from __future__ import annotations

import asyncio
import time

import pytest

from limits_helpers import ENGINE, LONG, aborted, assert_clean, greedy, ids, model, rejected, run  # noqa: F401
from pagedcore.async_engine import AsyncLLMEngine
from pagedcore.limits import EngineDeadError
from pagedcore.llm_engine import LLMEngine


# ---- item 4: graceful shutdown -------------------------------------------------------------------------------
def test_graceful_shutdown_stops_admitting_and_lets_requests_in_flight_finish(model):
    aeng = AsyncLLMEngine(LLMEngine(model=model, **ENGINE))

    async def main():
        # Long enough to be still running when the second request comes (40 tokens finished within a fixed
        # 0.05 s wait on a fast CPU); the wait is for the shutdown to begin, not a guess at its timing.
        stream = aeng.generate(ids(8), greedy(400))
        first = await stream.__anext__()
        stopping = asyncio.ensure_future(asyncio.to_thread(aeng.shutdown, 30.0))
        deadline = time.monotonic() + 5
        while aeng.healthy and time.monotonic() < deadline:
            await asyncio.sleep(0.001)
        assert not aeng.healthy
        with pytest.raises(EngineDeadError, match="shutting down"):
            await aeng.generate(ids(8), greedy(4)).__anext__()
        outs = [first] + [o async for o in stream]
        assert outs[-1].finished and not outs[-1].error
        assert sum(len(o.outputs[0].token_ids) for o in outs) == 400
        await stopping

    run(main())
    assert not aeng._thread.is_alive()
    assert rejected(aeng.engine)["unavailable"] == 1
    assert_clean(aeng.engine)


def test_shutdown_past_its_grace_period_aborts_what_is_left(model):
    aeng = AsyncLLMEngine(LLMEngine(model=model, **ENGINE))

    async def main():
        stream = aeng.generate(ids(8), LONG)
        await stream.__anext__()
        t0 = time.monotonic()
        await asyncio.to_thread(aeng.shutdown, 0.3)
        assert 0.3 <= time.monotonic() - t0 < 5
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass

    run(main())
    assert not aeng._thread.is_alive() and aborted(aeng.engine)["shutdown"] == 1
    assert_clean(aeng.engine)


def test_the_engine_is_a_context_manager(model):
    async def main():
        async with AsyncLLMEngine(LLMEngine(model=model, **ENGINE)) as aeng:
            outs = [o async for o in aeng.generate(ids(8), greedy(3))]
        assert outs[-1].finished and not aeng._thread.is_alive()

    run(main())
    with AsyncLLMEngine(LLMEngine(model=model, **ENGINE)) as aeng:
        pass
    assert not aeng._thread.is_alive()

"""Shared by the limits, shutdown and bad-input tests (issue 15): the tiny engine's settings and request helpers."""

from __future__ import annotations

import asyncio

import pytest

from pagedcore import SamplingParams
from pagedcore.limits import ABORT_REASONS, REJECT_REASONS

ENGINE = dict(num_kv_blocks=64, block_size=8, num_threads=1)
TIMEOUT = 60
# To the 512-token context: only an end stops it. logprobs=0: every step computes the whole logits row (the greedy
# head's argmax-only steps run the tiny model's ~500 tokens inside these tests' deadlines).
LONG = dict(temperature=0.0, max_tokens=None, ignore_eos=True, logprobs=0)


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def ids(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


def rejected(engine) -> dict[str, int]:
    return dict(zip(REJECT_REASONS, engine.rejected.snapshot()))


def aborted(engine) -> dict[str, int]:
    return dict(zip(ABORT_REASONS, engine.aborted.snapshot()))


def assert_clean(engine) -> None:
    assert engine.kv.num_free_blocks == engine.kv.num_blocks, "KV blocks leaked"
    assert not engine.requests, f"requests left: {list(engine.requests)}"
    s = engine.scheduler
    assert not s.waiting and not s.running and not s.swapped


def drain(engine, max_steps: int = 2000) -> dict:
    done = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return done
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    raise AssertionError(f"not finished after {max_steps} steps: {list(engine.requests)} (waiting "
                         f"{len(engine.scheduler.waiting)}, running {len(engine.scheduler.running)})")


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT))


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return str(tiny_model_dir("llama"))

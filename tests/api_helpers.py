"""Shared by the offline-API tests (test_api*.py, test_engine_step_loop.py): prompts, params, draining a
LLMEngine, the KV-pool check each test ends with. Their engines are fixtures in conftest.py."""

from __future__ import annotations

import torch

from pagedcore import SamplingParams

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


def tiny_prompts(n: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 49152, (int(k),), generator=g).tolist()
            for k in torch.randint(4, 30, (n,), generator=g)]


def sampled(seed, **kw):
    return SamplingParams(temperature=0.8, top_p=0.9, seed=seed, max_tokens=16, ignore_eos=True, **kw)

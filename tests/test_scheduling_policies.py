"""Scheduling policies (admission order, preemption victims), request priorities and cache salts."""

import asyncio
import gc
import weakref

import pytest

from pagedcore import LLM, SamplingParams
from pagedcore.async_engine import AsyncLLMEngine
from pagedcore.config import EngineConfig
from pagedcore.kv_cache_manager import KVCacheManager
from pagedcore.llm_engine import LLMEngine
from pagedcore.outputs import OutputKind
from pagedcore.sampling_params import InvalidRequestError
from pagedcore.scheduler import SampledOutput, Scheduler, SequenceSample
from pagedcore.scheduling_policies import FCFSPolicy, PriorityPolicy
from pagedcore.sequence import Sequence

BLOCK_SIZE = 4


def scheduler(policy, num_blocks=16, budget=64, max_seqs=8):
    cfg = EngineConfig(block_size=BLOCK_SIZE, max_num_batched_tokens=budget, max_num_seqs=max_seqs)
    return Scheduler(cfg, KVCacheManager(num_blocks, BLOCK_SIZE), policy)


def seq(i, priority=0, prompt_len=16):
    return Sequence(i, f"r{i}", 0, list(range(prompt_len)), SamplingParams(max_tokens=100), 64,
                    arrival_time=float(i), priority=priority)


def step(sched):
    """Schedule, then sample token 7 for every sequence whose chunk reached its end."""
    out = sched.schedule()
    samples = [SequenceSample(s, [7], [0.0]) for s, n in out.scheduled if s.num_computed_tokens + n == s.num_tokens]
    sched.update_from_output(out, SampledOutput(samples))
    return out


def test_priority_policy_admits_lower_values_first_then_by_arrival():
    sched = scheduler(PriorityPolicy(), max_seqs=1)
    seqs = [seq(0, priority=2), seq(1, priority=0), seq(2, priority=1), seq(3, priority=0)]
    for s in seqs:
        sched.add(s)
    assert [s.seq_id for s in sched.waiting] == [1, 3, 2, 0]
    assert [s.seq_id for s, _ in step(sched).scheduled] == [1]


def test_fcfs_ignores_priority():
    sched = scheduler(FCFSPolicy(), max_seqs=1)
    for s in [seq(0, priority=2), seq(1, priority=0)]:
        sched.add(s)
    assert [s.seq_id for s, _ in step(sched).scheduled] == [0]


@pytest.mark.parametrize("policy, victim", [(FCFSPolicy(), 3), (PriorityPolicy(), 1)])
def test_preemption_victim_is_the_policys_choice(policy, victim):
    sched = scheduler(policy)
    seqs = [seq(0, priority=0), seq(1, priority=5), seq(2, priority=1), seq(3, priority=2)]
    for s in seqs:
        sched.add(s)
    step(sched)  # 4 x 4 blocks: the pool is full
    assert sched.kv.num_free_blocks == 0
    out = step(sched)  # every sequence needs a 5th block now
    assert out.preempted[0] is seqs[victim]
    assert all(s is not seqs[victim] for s, _ in out.scheduled)


def test_a_preempted_sequence_waits_behind_more_urgent_ones():
    sched = scheduler(PriorityPolicy(), num_blocks=8, max_seqs=2)
    low, high = seq(0, priority=3), seq(1, priority=1)
    for s in (low, high):
        sched.add(s)
    step(sched)
    step(sched)  # both need a 5th block: the low-priority one gives way
    urgent = seq(2, priority=0)
    sched.add(urgent)
    assert list(sched.waiting) == [urgent, low]


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return str(tiny_model_dir("llama"))


def test_engine_runs_the_priority_policy_and_refuses_priorities_under_fcfs(tiny):
    fcfs = LLMEngine(model=tiny, num_kv_blocks=32, block_size=8)
    with pytest.raises(InvalidRequestError) as e:
        fcfs.add_request("a", [5, 6, 7], SamplingParams(max_tokens=2), priority=1)
    assert e.value.field == "priority" and "scheduling_policy='priority'" in str(e.value)
    assert not fcfs.requests and fcfs.kv.num_free_blocks == fcfs.kv.num_blocks
    eng = LLMEngine(model=tiny, num_kv_blocks=32, block_size=8, scheduling_policy="priority", max_num_seqs=1)
    for rid, prio in [("late", 5), ("urgent", -1), ("mid", 0)]:
        eng.add_request(rid, [5, 6, 7, 8], SamplingParams(max_tokens=3), priority=prio)
    done = []
    while eng.has_unfinished_requests():
        done += [o.request_id for o in eng.step() if o.finished]
    assert done == ["urgent", "mid", "late"]
    assert eng.kv.num_free_blocks == eng.kv.num_blocks


def test_cache_salt_keeps_prefix_reuse_within_one_salt(tiny):
    llm = LLM(tiny, num_kv_blocks=64, block_size=8)
    eng = llm.engine
    prompt = list(range(100, 140))  # 5 full blocks
    greedy = SamplingParams(max_tokens=2, temperature=0.0)

    def run(rid, salt):
        eng.add_request(rid, prompt, greedy, cache_salt=salt)
        outs = []
        while eng.has_unfinished_requests():
            outs += [o for o in eng.step() if o.finished]
        return outs[0]

    first = run("a1", "tenant-a")
    assert first.num_cached_tokens == 0
    assert run("b1", "tenant-b").num_cached_tokens == 0, "another tenant's blocks must not be reused"
    again = run("a2", "tenant-a")
    assert again.num_cached_tokens >= 32 and again.outputs[0].token_ids == first.outputs[0].token_ids
    assert run("none", None).num_cached_tokens == 0
    assert eng.kv.num_free_blocks == eng.kv.num_blocks


def test_a_dropped_engine_is_freed_without_the_cycle_collector(tiny):
    eng = LLMEngine(model=tiny, num_kv_blocks=16, block_size=8)
    eng.add_request("x", [5, 6, 7], SamplingParams(max_tokens=2))
    while eng.has_unfinished_requests():
        eng.step()
    ref = weakref.ref(eng)
    gc.disable()
    try:
        del eng
        assert ref() is None, "a reference cycle keeps the engine (and its KV cache) alive"
    finally:
        gc.enable()


def test_llm_generate_takes_one_priority_per_prompt(tiny):
    llm = LLM(tiny, num_kv_blocks=32, block_size=8, scheduling_policy="priority", max_num_seqs=1)
    greedy = SamplingParams(max_tokens=2, temperature=0.0)
    outs = llm.generate([[5, 6, 7], [8, 9, 10]], greedy, priority=[1, 0])
    assert [o.prompt_token_ids for o in outs] == [[5, 6, 7], [8, 9, 10]]
    assert outs[1].metrics.first_token_time < outs[0].metrics.first_token_time
    with pytest.raises(ValueError, match="priorities"):
        llm.generate([[5, 6, 7]], greedy, priority=[0, 1])
    fcfs = LLM(tiny, num_kv_blocks=32, block_size=8)
    with pytest.raises(InvalidRequestError):
        fcfs.generate([[5, 6, 7], [8, 9, 10]], greedy, priority=[0, 1])
    assert not fcfs.engine.requests and fcfs.engine.kv.num_free_blocks == fcfs.engine.kv.num_blocks


def test_async_engine_passes_priority_and_cache_salt_to_the_engine(tiny):
    """The front doors' path: AsyncLLMEngine.generate(priority=, cache_salt=) reaches add_request."""
    greedy = SamplingParams(max_tokens=2, temperature=0.0)
    long = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)

    async def finals(engine, jobs):
        async def one(rid, prompt, **kw):
            params = long if rid == "blocker" else greedy
            async for out in engine.generate(prompt, params, rid, OutputKind.FINAL_ONLY, **kw):
                last = out
            return last
        return await asyncio.gather(*(one(*job[:2], **job[2]) for job in jobs))

    async def main():
        async with AsyncLLMEngine(LLMEngine(model=tiny, num_kv_blocks=64, block_size=8, scheduling_policy="priority",
                                            max_num_seqs=1)) as engine:
            with pytest.raises(InvalidRequestError) as e:
                await anext(engine.generate([5, 6], greedy, cache_salt=""))
            assert e.value.field == "cache_salt"
            prompt = list(range(100, 140))  # 5 full blocks
            salted = await finals(engine, [("a1", prompt, {"cache_salt": "a"})])
            again = await finals(engine, [("b1", prompt, {"cache_salt": "b"}), ("a2", prompt, {"cache_salt": "a"})])
            # max_num_seqs=1: the others queue behind a long request, then run in priority order
            blocker = ("blocker", [5, 6], {"priority": 0})
            ordered = await finals(engine, [blocker] + [(f"p{p}", [7 + p, 8, 9], {"priority": p}) for p in (3, -2, 0)])
            return salted, again, ordered, engine.engine

    salted, (b1, a2), ordered, eng = asyncio.run(main())
    assert salted[0].num_cached_tokens == 0 and b1.num_cached_tokens == 0 and a2.num_cached_tokens >= 32
    firsts = {o.request_id: o.metrics.first_token_time for o in ordered}
    assert firsts["p-2"] < firsts["p0"] < firsts["p3"], firsts
    assert eng.kv.num_free_blocks == eng.kv.num_blocks

"""Scheduler invariants under random add / step / abort / finish interleavings (no model needed)."""

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedcore.config import EngineConfig
from pagedcore.kv_cache_manager import KVCacheManager, cdiv
from pagedcore.sampling_params import SamplingParams
from pagedcore.scheduler import Scheduler
from pagedcore.sequence import Sequence, SequenceStatus

NUM_BLOCKS, BLOCK_SIZE = 16, 4


def make_scheduler(budget=24, max_seqs=4, chunked=True):
    cfg = EngineConfig(block_size=BLOCK_SIZE, max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                       enable_chunked_prefill=chunked)
    return Scheduler(cfg, KVCacheManager(NUM_BLOCKS, BLOCK_SIZE))


def fake_step(sched: Scheduler, rng_token=7):
    """What the engine does after the model runs: advance computed tokens, append a sample."""
    out = sched.schedule()
    sampled = []
    for seq, n in out.scheduled:
        assert n >= 1
        assert seq.num_computed_tokens + n <= seq.num_tokens
        seq.num_computed_tokens += n
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(rng_token)
            sampled.append(seq)
    return out, sampled


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.sched = make_scheduler()
        self.live: list[Sequence] = []
        self.n = 0

    @rule(prompt_len=st.integers(1, 30), max_tokens=st.integers(1, 12))
    def add(self, prompt_len, max_tokens):
        seq = Sequence(self.n, f"r{self.n}", 0, list(range(prompt_len)), SamplingParams(max_tokens=max_tokens),
                       max_total_tokens=NUM_BLOCKS * BLOCK_SIZE)
        self.n += 1
        self.sched.add(seq)
        self.live.append(seq)

    @rule()
    def step(self):
        out, sampled = fake_step(self.sched)
        cfg = self.sched.config
        assert out.num_tokens <= cfg.max_num_batched_tokens
        assert len(self.sched.running) <= cfg.max_num_seqs
        ids = [id(s) for s, _ in out.scheduled]
        assert len(ids) == len(set(ids)), "a sequence scheduled twice in one step"
        for seq in out.preempted:
            assert seq.status is SequenceStatus.WAITING and seq.block_table == [] and seq.num_computed_tokens == 0
            assert seq not in [s for s, _ in out.scheduled]
        for seq in sampled:
            if seq.num_output_tokens >= seq.params.max_tokens or seq.num_tokens >= seq.max_total_tokens:
                self.sched.finish(seq, SequenceStatus.FINISHED_LENGTH)
                self.live.remove(seq)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort(self, data):
        seq = data.draw(st.sampled_from(self.live))
        self.sched.finish(seq, SequenceStatus.FINISHED_ABORTED)
        self.live.remove(seq)

    @invariant()
    def queues_partition_live_sequences(self):
        queued = list(self.sched.waiting) + self.sched.running
        assert sorted(id(s) for s in queued) == sorted(id(s) for s in self.live)

    @invariant()
    def blocks_owned_exactly_once(self):
        owned = [b for s in self.sched.running for b in s.block_table]
        assert len(owned) == len(set(owned)), "a block owned by two sequences without a fork"
        pool = self.sched.kv.pool
        assert not set(owned) & set(pool.free_block_ids), "a block both free and owned"
        assert len(owned) + pool.num_free_blocks == NUM_BLOCKS
        for s in self.sched.waiting:
            assert s.block_table == [] or s.num_computed_tokens > 0

    @invariant()
    def running_have_enough_blocks(self):
        for s in self.sched.running:
            assert len(s.block_table) >= cdiv(s.num_computed_tokens, BLOCK_SIZE)

    def teardown(self):
        # Everything drains: no deadlock, and the pool is whole again.
        for _ in range(2000):
            if not self.sched.has_unfinished():
                break
            self.step()
        assert not self.sched.has_unfinished(), "scheduler stopped making progress"
        assert self.sched.kv.num_free_blocks == NUM_BLOCKS


TestScheduler = SchedulerMachine.TestCase
TestScheduler.settings = settings(max_examples=120, stateful_step_count=50, deadline=None)


def test_running_first_then_waiting_within_budget():
    sched = make_scheduler(budget=10, max_seqs=8)
    a = Sequence(0, "a", 0, list(range(6)), SamplingParams(), 64)
    b = Sequence(1, "b", 0, list(range(8)), SamplingParams(), 64)
    sched.add(a)
    sched.add(b)
    out, _ = fake_step(sched)
    assert [(s.request_id, n) for s, n in out.scheduled] == [("a", 6), ("b", 4)]  # b's prompt is chunked
    out, _ = fake_step(sched)
    assert [(s.request_id, n) for s, n in out.scheduled] == [("a", 1), ("b", 4)]


def test_no_chunking_waits_for_budget():
    sched = make_scheduler(budget=10, chunked=False)
    sched.add(Sequence(0, "a", 0, list(range(6)), SamplingParams(), 64))
    sched.add(Sequence(1, "b", 0, list(range(8)), SamplingParams(), 64))
    out, _ = fake_step(sched)
    assert [s.request_id for s, _ in out.scheduled] == ["a"]


def test_preempts_newest_when_blocks_run_out():
    sched = make_scheduler(budget=64, max_seqs=8)
    seqs = [Sequence(i, f"r{i}", 0, list(range(16)), SamplingParams(max_tokens=100), 64) for i in range(4)]
    for s in seqs:
        sched.add(s)
    fake_step(sched)  # 4 x 4 blocks: the pool is full
    assert sched.kv.num_free_blocks == 0
    out, _ = fake_step(sched)  # each needs a 5th block now
    assert out.preempted and out.preempted[0] is seqs[3]
    assert sched.waiting[0] is seqs[3]
    assert sched.num_preemptions >= 1

"""Scheduler invariants under random add / draft / step / abort interleavings, and the life cycle
that `update_from_output` owns: sampled tokens, stops, forks, rollback of rejected drafts (no model
needed)."""

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedcore.config import EngineConfig
from pagedcore.kv_cache_manager import KVCacheManager, cdiv
from pagedcore.sampling_params import SamplingParams
from pagedcore.scheduler import SampledOutput, Scheduler, SequenceSample
from pagedcore.sequence import Sequence, SequenceStatus

NUM_BLOCKS, BLOCK_SIZE = 16, 4
TOKEN = 7  # what every fake step samples


def make_scheduler(budget=24, max_seqs=4, chunked=True, prefix_caching=False):
    cfg = EngineConfig(block_size=BLOCK_SIZE, max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                       enable_chunked_prefill=chunked)
    return Scheduler(cfg, KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, enable_prefix_caching=prefix_caching))


def fake_step(sched: Scheduler, drafts=None, num_accepted=lambda seq, k: k, forks=()):
    """One engine step without a model. Every sequence whose chunk reaches its end samples TOKEN;
    one whose last `drafts[seq_id]` tokens are drafts keeps the first `num_accepted` of them (the
    verifier's answer) before it; `forks` are (parent, child) samples that join their parent."""
    drafts = {} if drafts is None else drafts
    out = sched.schedule()
    samples = []
    for seq, n in out.scheduled:
        assert n >= 1 and seq.num_computed_tokens + n <= seq.num_tokens
        if seq.num_computed_tokens + n < seq.num_tokens:
            continue  # a chunk of a longer prompt: nothing is sampled yet
        k = drafts.pop(seq.seq_id, 0)
        a = num_accepted(seq, k)
        accepted = seq.token_ids[seq.num_tokens - k:][:a]
        samples.append(SequenceSample(seq, accepted + [TOKEN], [0.0] * (a + 1), num_draft_tokens=k))
    samples += [SequenceSample(child, [TOKEN], [0.0], fork_of=parent) for parent, child in forks]
    sched.update_from_output(out, SampledOutput(samples))
    return out, [s.seq for s in samples]


def add_drafts(seq: Sequence, drafts: dict, draft_ids: list[int]) -> None:
    """What a drafter would do: propose tokens after the last sampled one."""
    seq.token_ids += draft_ids
    drafts[seq.seq_id] = len(draft_ids)


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.sched = make_scheduler()
        self.live: list[Sequence] = []
        self.drafts: dict[int, int] = {}  # seq_id -> its trailing draft tokens, not yet verified
        self.n = 0

    @rule(prompt_len=st.integers(1, 30), max_tokens=st.integers(1, 12))
    def add(self, prompt_len, max_tokens):
        seq = Sequence(self.n, f"r{self.n}", 0, list(range(prompt_len)), SamplingParams(max_tokens=max_tokens),
                       max_total_tokens=NUM_BLOCKS * BLOCK_SIZE)
        self.n += 1
        self.sched.add(seq)
        self.live.append(seq)

    def _draftable(self) -> list[Sequence]:
        return [s for s in self.sched.running if s.seq_id not in self.drafts
                and s.num_computed_tokens == s.num_tokens - 1 and s.num_tokens + 1 < s.max_total_tokens]

    @precondition(lambda self: self._draftable())
    @rule(data=st.data())
    def draft(self, data):
        seq = data.draw(st.sampled_from(self._draftable()))
        k = data.draw(st.integers(1, min(5, seq.max_total_tokens - seq.num_tokens - 1)))
        add_drafts(seq, self.drafts, [100 + i for i in range(k)])

    @rule(data=st.data())
    def step(self, data):
        before = {s.seq_id: (list(s.token_ids), self.drafts.get(s.seq_id, 0)) for s in self.live}
        out, sampled = fake_step(self.sched, self.drafts, lambda seq, k: data.draw(st.integers(0, k)))
        cfg = self.sched.config
        assert out.num_tokens <= cfg.max_num_batched_tokens
        assert len(self.sched.running) <= cfg.max_num_seqs
        ids = [id(s) for s, _ in out.scheduled]
        assert len(ids) == len(set(ids)), "a sequence scheduled twice in one step"
        for seq in out.preempted:
            assert seq.status is SequenceStatus.WAITING and seq.block_table == [] and seq.num_computed_tokens == 0
            assert seq not in [s for s, _ in out.scheduled]
        for seq in sampled:
            tokens, k = before[seq.seq_id]
            kept = len(tokens) - k  # the drafts left; the accepted ones came back
            assert seq.token_ids[:kept] == tokens[:kept] and seq.token_ids[-1] in (TOKEN, *tokens[kept:])
            if not seq.is_finished:
                assert seq.token_ids[-1] == TOKEN and seq.num_computed_tokens == seq.num_tokens - 1
            else:
                assert seq.status is SequenceStatus.FINISHED_LENGTH and seq.block_table == []
                assert seq.num_output_tokens == seq.params.max_tokens or seq.num_tokens >= seq.max_total_tokens
        self.live = [s for s in self.live if not s.is_finished]

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort(self, data):
        seq = data.draw(st.sampled_from(self.live))
        self.sched.finish(seq, SequenceStatus.FINISHED_ABORTED)
        self.drafts.pop(seq.seq_id, None)
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
        assert sorted(b for b, refs in enumerate(pool.ref_counts) if refs) == sorted(owned)
        assert all(pool.ref_counts[b] == 1 for b in owned)
        for s in self.sched.waiting:
            assert s.block_table == [] or s.num_computed_tokens > 0

    @invariant()
    def running_hold_blocks_for_their_kv_and_no_more(self):
        # No more: the blocks of rejected drafts went back to the pool.
        for s in self.sched.running:
            assert len(s.block_table) == cdiv(s.num_computed_tokens, BLOCK_SIZE)

    def teardown(self):
        # Everything drains: no deadlock, and the pool is whole again.
        for _ in range(2000):
            if not self.sched.has_unfinished():
                break
            fake_step(self.sched, self.drafts)
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


# ---- update_from_output: rollback of rejected draft tokens ------------------------------------
def running_after_prefill(sched, prompt, max_tokens=50):
    seq = Sequence(0, "r", 0, list(prompt), SamplingParams(max_tokens=max_tokens), NUM_BLOCKS * BLOCK_SIZE)
    sched.add(seq)
    fake_step(sched)
    assert seq.num_computed_tokens == len(prompt) and seq.output_token_ids == [TOKEN]
    return seq


def test_rejected_drafts_rewind_the_kv_and_return_their_blocks_to_the_pool():
    sched = make_scheduler()
    pool = sched.kv.pool
    seq = running_after_prefill(sched, range(6))  # 7 tokens, 6 computed: 2 blocks
    drafts = {}
    add_drafts(seq, drafts, [100, 101, 102, 103, 104])
    fake_step(sched, drafts, num_accepted=lambda s, k: 1)  # 6 computed this step: 12 tokens, 3 blocks
    # 1 of 5 drafts accepted, then the sampled token: the KV of 4 rejected drafts is gone.
    assert seq.output_token_ids == [TOKEN, 100, TOKEN]
    assert seq.num_computed_tokens == 8 == seq.num_tokens - 1
    assert len(seq.block_table) == 2 and pool.num_free_blocks == NUM_BLOCKS - 2
    assert [pool.ref_counts[b] for b in seq.block_table] == [1, 1]
    assert sum(pool.ref_counts) == 2  # the third block's one reference was dropped
    fake_step(sched)  # the next token goes where the rejected drafts were
    assert seq.num_computed_tokens == 9 and len(seq.block_table) == 3


def test_all_drafts_rejected_leaves_the_sequence_as_if_none_were_proposed():
    sched = make_scheduler()
    seq = running_after_prefill(sched, range(4))  # 5 tokens, 4 computed: 1 block
    drafts = {}
    add_drafts(seq, drafts, [100, 101, 102, 103, 104, 105])
    fake_step(sched, drafts, num_accepted=lambda s, k: 0)
    assert seq.output_token_ids == [TOKEN, TOKEN]
    assert seq.num_computed_tokens == 5 and len(seq.block_table) == 2
    assert sched.kv.num_free_blocks == NUM_BLOCKS - 2


def test_rollback_of_a_forked_sequence_keeps_the_shared_blocks_shared():
    sched = make_scheduler()
    pool = sched.kv.pool
    parent = Sequence(0, "r", 0, list(range(8)), SamplingParams(max_tokens=50), 64)
    child = Sequence(1, "r", 1, list(range(8)), SamplingParams(max_tokens=50), 64)
    sched.add(parent)
    fake_step(sched, forks=[(parent, child)])  # the child shares the prompt's two full blocks
    shared = list(parent.block_table)
    assert child.block_table == shared and [pool.ref_counts[b] for b in shared] == [2, 2]
    assert child in sched.running and child.output_token_ids == [TOKEN]
    drafts = {}
    add_drafts(parent, drafts, [100, 101, 102, 103, 104, 105])
    fake_step(sched, drafts, num_accepted=lambda s, k: 0)
    assert parent.block_table[:2] == shared and [pool.ref_counts[b] for b in shared] == [2, 2]
    assert len(parent.block_table) == cdiv(parent.num_computed_tokens, BLOCK_SIZE) == 3
    owned = parent.block_table + child.block_table[2:]
    assert sorted(b for b, refs in enumerate(pool.ref_counts) if refs) == sorted(set(owned))
    for seq in (parent, child):
        sched.finish(seq, SequenceStatus.FINISHED_ABORTED)
    assert pool.num_free_blocks == NUM_BLOCKS and not any(pool.ref_counts)


def test_rejected_drafts_are_never_published_to_the_prefix_cache():
    def cached_tokens_for(accept):
        sched = make_scheduler(prefix_caching=True)
        seq = running_after_prefill(sched, [1, 2, 3])  # [1, 2, 3, TOKEN]: one block once computed
        drafts = {}
        add_drafts(seq, drafts, [50, 51, 52, 53, 54])
        fake_step(sched, drafts, num_accepted=lambda s, k: accept)
        probe = Sequence(9, "probe", 0, [1, 2, 3, TOKEN, 50, 51, 52, 53, 60], SamplingParams(), 64)
        return len(sched.kv.find_cached_prefix(probe)) * BLOCK_SIZE

    assert cached_tokens_for(accept=5) == 8  # accepted drafts are real tokens: their block is reused
    assert cached_tokens_for(accept=0) == 4  # rejected ones never reach the prefix cache


def test_a_stop_among_accepted_drafts_drops_the_tokens_after_it():
    sched = make_scheduler()
    seq = running_after_prefill(sched, range(5), max_tokens=3)
    drafts = {}
    add_drafts(seq, drafts, [100, 101, 102, 103])
    fake_step(sched, drafts)  # all accepted, but max_tokens ends the sequence at the second one
    assert seq.status is SequenceStatus.FINISHED_LENGTH
    assert seq.output_token_ids == [TOKEN, 100, 101]
    assert sched.kv.num_free_blocks == NUM_BLOCKS and not sched.has_unfinished()


def test_stop_token_among_drafts_finishes_with_its_reason():
    sched = make_scheduler()
    seq = Sequence(0, "r", 0, list(range(5)), SamplingParams(max_tokens=50, stop_token_ids=[101]), 64)
    sched.add(seq)
    fake_step(sched)
    drafts = {}
    add_drafts(seq, drafts, [100, 101, 102])
    fake_step(sched, drafts)
    assert seq.status is SequenceStatus.FINISHED_STOPPED and seq.stop_reason == 101
    assert seq.output_token_ids == [TOKEN, 100, 101]

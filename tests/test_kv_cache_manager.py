"""KV cache manager invariants under random interleavings (hypothesis stateful)."""

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedcore.kv_cache_manager import KVCacheManager, cdiv
from pagedcore.sampling_params import SamplingParams
from pagedcore.sequence import Sequence

NUM_BLOCKS = 24


def make_seq(i: int, prompt_len: int = 1) -> Sequence:
    return Sequence(i, f"r{i}", 0, list(range(prompt_len)), SamplingParams(), max_total_tokens=10_000)


class KVCacheManagerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.block_size = 4
        self.kv = KVCacheManager(NUM_BLOCKS, self.block_size)
        self.seqs: list[Sequence] = []
        self.next_id = 0

    @rule(num_tokens=st.integers(1, 40))
    def allocate_new(self, num_tokens):
        seq = make_seq(self.next_id)
        self.next_id += 1
        free_before = self.kv.num_free_blocks
        ok = self.kv.allocate_slots(seq, num_tokens)
        assert ok == (cdiv(num_tokens, self.block_size) <= free_before)
        if ok:
            seq.num_computed_tokens = num_tokens
            self.seqs.append(seq)
        else:
            assert self.kv.num_free_blocks == free_before and not seq.block_table

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), num_tokens=st.integers(1, 9))
    def append(self, data, num_tokens):
        seq = data.draw(st.sampled_from(self.seqs))
        free_before = self.kv.num_free_blocks
        needed = self.kv.num_blocks_needed(seq, num_tokens)
        if self.kv.allocate_slots(seq, num_tokens):
            seq.num_computed_tokens += num_tokens
            assert self.kv.num_free_blocks == free_before - needed
        else:
            assert needed > free_before and self.kv.num_free_blocks == free_before

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self.seqs))
        child = make_seq(self.next_id)
        self.next_id += 1
        self.kv.fork(parent, child)
        assert child.block_table == parent.block_table
        self.seqs.append(child)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(self.seqs))
        self.seqs.remove(seq)
        self.kv.free(seq)
        assert seq.block_table == []

    @rule()
    def drain_copies(self):
        for src, dst in self.kv.take_pending_copies():
            assert src != dst

    @invariant()
    def ref_counts_exact(self):
        counts = [0] * NUM_BLOCKS
        for seq in self.seqs:
            for b in seq.block_table:
                counts[b] += 1
        assert counts == self.kv.pool.ref_counts

    @invariant()
    def free_list_is_exactly_unowned_blocks(self):
        free = list(self.kv.pool.free_block_ids)
        assert len(free) == len(set(free)), "a block is on the free list twice"
        assert set(free) == {b for b in range(NUM_BLOCKS) if self.kv.pool.ref_counts[b] == 0}

    @invariant()
    def tables_cover_computed_tokens(self):
        for seq in self.seqs:
            assert len(seq.block_table) >= cdiv(seq.num_computed_tokens, self.block_size)

    def teardown(self):
        for seq in self.seqs:
            self.kv.free(seq)
        assert self.kv.num_free_blocks == NUM_BLOCKS, "blocks leaked"


TestKVCacheManager = KVCacheManagerMachine.TestCase
TestKVCacheManager.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_copy_on_write_of_shared_partial_last_block():
    kv = KVCacheManager(8, 4)
    parent = make_seq(0)
    assert kv.allocate_slots(parent, 6)  # 2 blocks, the second half full
    parent.num_computed_tokens = 6
    child = make_seq(1)
    kv.fork(parent, child)
    assert kv.pool.ref_counts[parent.block_table[1]] == 2
    assert kv.allocate_slots(child, 1)  # child writes into the shared partial block: copy first
    assert child.block_table[0] == parent.block_table[0]
    assert child.block_table[1] != parent.block_table[1]
    assert kv.take_pending_copies() == [(parent.block_table[1], child.block_table[1])]
    assert kv.pool.ref_counts[parent.block_table[1]] == 1
    kv.free(parent)
    kv.free(child)
    assert kv.num_free_blocks == 8


def test_full_shared_blocks_are_not_copied():
    kv = KVCacheManager(8, 4)
    parent = make_seq(0)
    assert kv.allocate_slots(parent, 8)
    parent.num_computed_tokens = 8
    child = make_seq(1)
    kv.fork(parent, child)
    assert kv.allocate_slots(child, 1)  # a fresh block; nothing shared is written
    assert kv.take_pending_copies() == []
    assert child.block_table[:2] == parent.block_table and len(child.block_table) == 3

"""Fork, copy-on-write, swap and prefix hits under random interleavings (hypothesis stateful).

A simulated KV content per physical block lets the test check the property that matters: every
computed position of every sequence reads back its own KV, whatever was shared, copied, swapped,
cached or evicted on the way. The KV at position p depends on every token up to p, so the
simulated content of a slot is that whole prefix.
"""

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedcore.kv_cache_manager import KVCacheManager
from pagedcore.sampling_params import SamplingParams
from pagedcore.sequence import Sequence

NUM_BLOCKS, NUM_CPU_BLOCKS, BS = 20, 12, 4
# A small alphabet and a shared stem make prefix hits common.
STEM = [7, 7, 1, 2, 3, 4, 5, 6, 1, 2]


class KVSharingMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.kv = KVCacheManager(NUM_BLOCKS, BS, enable_prefix_caching=True, num_cpu_blocks=NUM_CPU_BLOCKS)
        self.dev = {}  # (block, offset) -> token written there
        self.cpu = {}
        self.live: list[Sequence] = []  # own device blocks
        self.swapped: list[Sequence] = []
        self.n = 0

    def _new_seq(self, tokens):
        self.n += 1
        return Sequence(self.n, f"r{self.n}", 0, tokens, SamplingParams(), max_total_tokens=1000)

    def _write(self, seq, start, end):
        for p in range(start, end):
            self.dev[(seq.block_table[p // BS], p % BS)] = tuple(seq.token_ids[:p + 1])

    def _apply_copies(self):
        for src, dst in self.kv.take_pending_copies():
            for off in range(BS):
                if (src, off) in self.dev:
                    self.dev[(dst, off)] = self.dev[(src, off)]

    @rule(stem=st.integers(0, len(STEM)), tail=st.lists(st.integers(1, 3), max_size=8), budget=st.integers(1, 16))
    def admit(self, stem, tail, budget):
        tokens = STEM[:stem] + tail or [1]
        seq = self._new_seq(tokens)
        hits_before = self.kv.num_prefix_hit_tokens
        num_new = self.kv.allocate_new_sequence(seq, budget, allow_chunking=True)
        if num_new is None:
            assert seq.block_table == [] and seq.num_computed_tokens == 0
            return
        assert seq.num_computed_tokens == self.kv.num_prefix_hit_tokens - hits_before
        assert seq.num_computed_tokens % BS == 0 and seq.num_computed_tokens < seq.num_tokens
        self._write(seq, seq.num_computed_tokens, seq.num_computed_tokens + num_new)
        seq.num_computed_tokens += num_new
        self.kv.cache_full_blocks(seq)
        self.live.append(seq)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), token=st.integers(1, 3))
    def decode(self, data, token):
        seq = data.draw(st.sampled_from(self.live))
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(token)
        num_new = seq.num_tokens - seq.num_computed_tokens
        if not self.kv.allocate_slots(seq, num_new):
            return
        self._apply_copies()
        self._write(seq, seq.num_computed_tokens, seq.num_tokens)
        seq.num_computed_tokens = seq.num_tokens
        self.kv.cache_full_blocks(seq)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self.live))
        child = self._new_seq(list(parent.prompt_token_ids))
        child.token_ids = list(parent.token_ids)
        self.kv.fork(parent, child)
        self.live.append(child)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(self.live))
        self.live.remove(seq)
        self.kv.free(seq)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def swap_out(self, data):
        seq = data.draw(st.sampled_from(self.live))
        if not self.kv.can_swap_out(seq):
            return
        for dev_b, cpu_b in self.kv.swap_out(seq):
            for off in range(BS):
                if (dev_b, off) in self.dev:
                    self.cpu[(cpu_b, off)] = self.dev[(dev_b, off)]
        self.live.remove(seq)
        self.swapped.append(seq)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data):
        seq = data.draw(st.sampled_from(self.swapped))
        if not self.kv.can_swap_in(seq, 0):
            return
        for cpu_b, dev_b in self.kv.swap_in(seq):
            for off in range(BS):
                if (cpu_b, off) in self.cpu:
                    self.dev[(dev_b, off)] = self.cpu[(cpu_b, off)]
        self.kv.cache_full_blocks(seq)
        self.swapped.remove(seq)
        self.live.append(seq)

    @invariant()
    def every_computed_position_reads_back_its_token(self):
        for seq in self.live:
            for p in range(seq.num_computed_tokens):
                assert self.dev.get((seq.block_table[p // BS], p % BS)) == tuple(seq.token_ids[:p + 1]), (seq.seq_id, p)

    @invariant()
    def ref_counts_exact(self):
        counts = [0] * NUM_BLOCKS
        for seq in self.live:
            for b in seq.block_table:
                counts[b] += 1
        assert counts == self.kv.pool.ref_counts
        cpu_counts = [0] * NUM_CPU_BLOCKS
        for seq in self.swapped:
            assert seq.block_table == []
            for b in seq.cpu_block_table:
                cpu_counts[b] += 1
        assert cpu_counts == self.kv.cpu_pool.ref_counts

    @invariant()
    def no_block_both_free_and_owned(self):
        pool = self.kv.pool
        free = set(pool.free_block_ids)
        assert len(free) == pool.num_free_blocks
        assert free == {b for b in range(NUM_BLOCKS) if pool.ref_counts[b] == 0}

    @invariant()
    def cache_index_consistent(self):
        pool = self.kv.pool
        for h, b in pool.cached_blocks.items():
            assert pool.block_hashes[b] == h
        assert sum(h is not None for h in pool.block_hashes) == len(pool.cached_blocks)

    def teardown(self):
        for seq in self.live + self.swapped:
            self.kv.free(seq)
        assert self.kv.num_free_blocks == NUM_BLOCKS, "device blocks leaked"
        assert self.kv.cpu_pool.num_free_blocks == NUM_CPU_BLOCKS, "cpu blocks leaked"


TestKVSharing = KVSharingMachine.TestCase
TestKVSharing.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)


def test_prefix_hit_reuses_blocks_and_leaves_one_token_to_compute():
    kv = KVCacheManager(16, BS, enable_prefix_caching=True)
    a = Sequence(0, "a", 0, list(range(12)), SamplingParams(), 100)
    assert kv.allocate_new_sequence(a, 100, True) == 12
    a.num_computed_tokens = 12
    kv.cache_full_blocks(a)
    a_blocks = list(a.block_table)
    kv.free(a)  # cached blocks stay reusable after free
    b = Sequence(1, "b", 0, list(range(12)), SamplingParams(), 100)
    assert kv.allocate_new_sequence(b, 100, True) == 4  # 2 full blocks hit, the last one recomputed
    assert b.block_table[:2] == a_blocks[:2]
    assert b.num_computed_tokens == 8
    c = Sequence(2, "c", 0, list(range(100, 112)), SamplingParams(), 100)
    assert kv.allocate_new_sequence(c, 100, True) == 12  # a different prefix never matches

"""The persistent input batch under random interleavings driven through the real Scheduler and KVCacheManager
(hypothesis stateful): every step equals the list-based reference step (input_batch_helpers.reference_step)."""

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from input_batch_helpers import BS, check_step
from pagedcore.config import EngineConfig
from pagedcore.input_batch import InputBatch
from pagedcore.kv_cache_manager import KVCacheManager
from pagedcore.sampling_params import SamplingParams
from pagedcore.scheduler import Scheduler
from pagedcore.sequence import Sequence, SequenceStatus

# ---- random interleavings through the real Scheduler and KVCacheManager ------------------------
NUM_BLOCKS, NUM_CPU_BLOCKS = 24, 16


class InputBatchMachine(RuleBasedStateMachine):
    """Steps of a tiny engine without a model: schedule, check the batch, advance, sample; plus
    adds, aborts and forks. A small pool forces recompute and swap preemption; a shared stem and
    the prefix cache give admissions with filled block tables."""

    def __init__(self):
        super().__init__()
        cfg = EngineConfig(block_size=BS, max_num_batched_tokens=20, max_num_seqs=3, preemption_mode="auto",
                           swap_min_tokens=10)
        self.kv = KVCacheManager(NUM_BLOCKS, BS, enable_prefix_caching=True, num_cpu_blocks=NUM_CPU_BLOCKS)
        self.sched = Scheduler(cfg, self.kv)
        self.batch = InputBatch(cfg.max_num_seqs, 32, BS)  # rows and columns both have to grow
        self.live: list[Sequence] = []
        self.n = 0

    def _seq(self, tokens):
        self.n += 1
        return Sequence(self.n, f"r{self.n}", 0, tokens, SamplingParams(), max_total_tokens=NUM_BLOCKS * BS // 2)

    @rule(stem=st.integers(0, 9), tail=st.lists(st.integers(1, 3), max_size=12))
    def add(self, stem, tail):
        seq = self._seq(list(range(stem)) + tail or [1])
        self.sched.add(seq)
        self.live.append(seq)

    @rule(tokens=st.lists(st.integers(1, 3), min_size=8, max_size=8), forks=st.lists(st.booleans(), min_size=8,
                                                                                    max_size=8))
    def step(self, tokens, forks):
        out = self.sched.schedule()
        if out.is_empty:
            return
        check_step(self.batch, out)
        sampled = []
        for seq, n in out.scheduled:
            seq.num_computed_tokens += n
            self.kv.cache_full_blocks(seq)
            if seq.num_computed_tokens == seq.num_tokens:
                sampled.append(seq)
        for i, seq in enumerate(sampled):
            if forks[i % 8] and len(self.live) < 8:  # a sample (or beam) forks before appending
                child = self._seq(list(seq.prompt_token_ids))
                child.token_ids = list(seq.token_ids)
                self.kv.fork(seq, child)
                self.sched.add_running(child)
                self.live.append(child)
                child.token_ids.append(tokens[(i + 1) % 8])
            seq.token_ids.append(tokens[i % 8])
        for seq in sampled:
            if seq.num_tokens >= seq.max_total_tokens:
                self.sched.finish(seq, SequenceStatus.FINISHED_LENGTH)
                self.live.remove(seq)
        self.kv.take_pending_copies()

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort(self, data):
        seq = data.draw(st.sampled_from(self.live))
        self.sched.finish(seq, SequenceStatus.FINISHED_ABORTED)
        self.live.remove(seq)

    @invariant()
    def rows_belong_to_live_or_not_yet_reported_sequences(self):
        pending = set(self.sched._finished_seq_ids)
        for seq_id, row in self.batch.row_of.items():
            owner = self.batch.owner[row]
            assert owner.seq_id == seq_id and (not owner.is_finished or seq_id in pending)
        assert len(self.batch.row_of) + len(self.batch.free_rows) == self.batch.num_rows

    def teardown(self):
        for _ in range(3000):
            if not self.sched.has_unfinished():
                break
            self.step([1] * 8, [False] * 8)
        assert not self.sched.has_unfinished()


TestInputBatchMachine = InputBatchMachine.TestCase
TestInputBatchMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)

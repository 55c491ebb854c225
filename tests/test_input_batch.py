"""The persistent input batch builds exactly the step the old list-based prepare() built.

Every step is checked tensor for tensor (values and dtypes) against `reference_step`, the
list-based code ModelRunner.prepare used before rows persisted, through admissions, decode
appends, block growth, finish and abort, recompute and swap preemption, forks, copy-on-write of
a shared last block and prefix-cache hits; first in directed scenarios, then under random
interleavings driven through the real Scheduler and KVCacheManager (test_input_batch_machine.py).
"""

import torch

from input_batch_helpers import BS, assert_same, check_step, reference_step
from pagedcore.attention.backend import AttentionMetadata
from pagedcore.config import EngineConfig
from pagedcore.input_batch import InputBatch
from pagedcore.kv_cache_manager import KVCacheManager
from pagedcore.model_runner import ModelInput, ModelRunner
from pagedcore.sampling_params import SamplingParams
from pagedcore.scheduler import Scheduler, SchedulerOutput
from pagedcore.sequence import Sequence, SequenceStatus


def new_seq(seq_id: int, tokens: list[int]) -> Sequence:
    return Sequence(seq_id, f"r{seq_id}", 0, tokens, SamplingParams(), max_total_tokens=1000)


def step(batch: InputBatch, scheduled: list[tuple[Sequence, int]], token: int = 5, **news) -> None:
    """Check one step, then do what the engine does after the model: advance, sample a token."""
    check_step(batch, SchedulerOutput(scheduled=scheduled, **news))
    for seq, n in scheduled:
        seq.num_computed_tokens += n
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(token)


def admit(kv: KVCacheManager, seq: Sequence, budget: int = 1000) -> tuple[Sequence, int]:
    n = kv.allocate_new_sequence(seq, budget, allow_chunking=True)
    assert n is not None
    return seq, n


def decode(kv: KVCacheManager, seq: Sequence) -> tuple[Sequence, int]:
    n = seq.num_tokens - seq.num_computed_tokens
    assert kv.allocate_slots(seq, n)
    return seq, n


def test_decode_steps_append_tokens_and_blocks_to_known_rows():
    kv = KVCacheManager(64, BS)
    batch = InputBatch(max_num_seqs=4, max_model_len=64, block_size=BS)
    a, b = new_seq(0, list(range(10, 17))), new_seq(1, [3, 1, 4])
    step(batch, [admit(kv, a), admit(kv, b)])
    rows = dict(batch.row_of)
    for t in range(9):  # a crosses two block boundaries, b one
        step(batch, [decode(kv, a), decode(kv, b)], token=100 + t)
    assert batch.row_of == rows and batch.num_tokens[rows[0]] == a.num_tokens - 1
    assert batch.num_blocks[rows[0]] == len(a.block_table) == 4


def test_chunked_prefill_and_decode_in_one_step():
    kv = KVCacheManager(64, BS)
    batch = InputBatch(max_num_seqs=4, max_model_len=64, block_size=BS)
    a, long = new_seq(0, [1, 2, 3]), new_seq(1, list(range(30)))
    step(batch, [admit(kv, a)])
    step(batch, [decode(kv, a), admit(kv, long, budget=9)])  # a chunk that samples nothing
    while long.num_computed_tokens < long.num_tokens - 1:
        n = min(7, long.num_tokens - long.num_computed_tokens)
        assert kv.allocate_slots(long, n)
        step(batch, [decode(kv, a), (long, n)])


def test_finished_row_is_reused_without_stale_blocks():
    kv = KVCacheManager(64, BS)
    batch = InputBatch(max_num_seqs=2, max_model_len=64, block_size=BS)
    a, b = new_seq(0, list(range(20))), new_seq(1, [1, 2])
    step(batch, [admit(kv, a), admit(kv, b)])
    row_a = batch.row_of[0]
    kv.free(a)
    c = new_seq(2, [9, 9, 9])  # far fewer blocks than a: its row must read 0 past them
    step(batch, [decode(kv, b), admit(kv, c)], finished_seq_ids=[0])
    assert 0 not in batch.row_of and batch.row_of[2] == row_a
    step(batch, [admit(kv, new_seq(3, [4, 4])), decode(kv, c)], finished_seq_ids=[1])  # b's row reused


def test_recompute_preemption_and_readmission_with_prefix_hits():
    kv = KVCacheManager(64, BS, enable_prefix_caching=True)
    batch = InputBatch(max_num_seqs=4, max_model_len=64, block_size=BS)
    a = new_seq(0, list(range(13)))
    step(batch, [admit(kv, a)])
    kv.cache_full_blocks(a)
    for _ in range(3):
        step(batch, [decode(kv, a)])
        kv.cache_full_blocks(a)
    kv.free(a)  # recompute preemption: blocks dropped, num_computed_tokens back to 0
    a.status = SequenceStatus.WAITING
    seq, n = admit(kv, a)
    assert a.num_computed_tokens > 0  # its full blocks come back from the prefix cache
    step(batch, [(seq, n)], preempted=[a])
    step(batch, [decode(kv, a)])


def test_unreported_preemption_is_noticed_by_the_new_block_list():
    kv = KVCacheManager(64, BS, enable_prefix_caching=False)
    batch = InputBatch(max_num_seqs=4, max_model_len=64, block_size=BS)
    a, filler = new_seq(0, list(range(9))), new_seq(1, list(range(50, 62)))
    step(batch, [admit(kv, a)])
    kv.free(a)
    step(batch, [admit(kv, filler)])  # takes a's old blocks
    step(batch, [admit(kv, a, budget=3), decode(kv, filler)])  # nobody said a was preempted; 1 block now


def test_any_replaced_list_is_copied_whole():
    # Hand-made tables: the same length and last block as before, other ids changed; and a
    # sequence whose token list is replaced (the engine only appends, but a row must not care).
    batch = InputBatch(max_num_seqs=2, max_model_len=64, block_size=BS)
    a = new_seq(0, list(range(10)))
    a.block_table = [4, 5, 6]
    step(batch, [(a, 10)])
    a.block_table = [7, 8, 6]
    step(batch, [(a, 1)])
    a.token_ids = [9] * a.num_tokens + [1]
    step(batch, [(a, 1)])


def test_swap_out_and_in_replaces_every_block_id():
    kv = KVCacheManager(32, BS, num_cpu_blocks=16)
    batch = InputBatch(max_num_seqs=4, max_model_len=64, block_size=BS)
    a, b = new_seq(0, list(range(10))), new_seq(1, list(range(7)))
    step(batch, [admit(kv, a), admit(kv, b)])
    old = list(a.block_table)
    kv.swap_out(a)
    step(batch, [decode(kv, b)], preempted=[a])
    step(batch, [admit(kv, new_seq(2, list(range(30))))])  # reuse a's device blocks meanwhile
    kv.swap_in(a)
    assert a.block_table != old
    step(batch, [decode(kv, a), decode(kv, b)])


def test_fork_gives_the_child_a_row_and_copy_on_write_reaches_the_parents_row():
    kv = KVCacheManager(64, BS)
    batch = InputBatch(max_num_seqs=4, max_model_len=64, block_size=BS)
    parent = new_seq(0, list(range(6)))  # 6 tokens: the last block is partial when forked
    check_step(batch, SchedulerOutput(scheduled=[admit(kv, parent)]))
    parent.num_computed_tokens = parent.num_tokens
    child = new_seq(1, list(parent.prompt_token_ids))
    kv.fork(parent, child)
    parent.token_ids.append(7)
    child.token_ids.append(8)
    last = parent.block_table[-1]
    scheduled = [decode(kv, parent), decode(kv, child)]
    assert parent.block_table[-1] != last and kv.take_pending_copies() == [(last, parent.block_table[-1])]
    step(batch, scheduled)
    assert batch.row_of[0] != batch.row_of[1]
    for t in range(6):
        step(batch, [decode(kv, parent), decode(kv, child)], token=20 + t)


def test_child_scheduled_first_copies_and_the_parent_then_writes_in_place():
    # The other order: the child (a new row) copies the shared block; the parent's row keeps its
    # blocks and the parent now writes into its last block in place.
    kv = KVCacheManager(64, BS)
    batch = InputBatch(max_num_seqs=4, max_model_len=64, block_size=BS)
    parent = new_seq(0, list(range(5)))
    step(batch, [admit(kv, parent)])
    child = new_seq(1, list(parent.prompt_token_ids))
    kv.fork(parent, child)
    child.token_ids = list(parent.token_ids)
    child.token_ids[-1] = 9  # sampled a different token than the parent
    step(batch, [decode(kv, child), decode(kv, parent)])
    step(batch, [decode(kv, child), decode(kv, parent)])


def test_rows_grow_past_max_num_seqs_and_columns_past_max_model_len():
    kv = KVCacheManager(256, BS)
    batch = InputBatch(max_num_seqs=1, max_model_len=8, block_size=BS)
    parent = new_seq(0, list(range(6)))
    step(batch, [admit(kv, parent)])
    children = []
    for i in range(3):  # n > max_num_seqs samples fork into running
        c = new_seq(1 + i, [])
        c.token_ids = list(parent.token_ids)
        kv.fork(parent, c)
        children.append(c)
    seqs = [parent] + children
    for t in range(12):  # past 8 tokens
        step(batch, [decode(kv, s) for s in seqs], token=t)
    assert batch.num_rows >= 4 and batch.token_ids.shape[1] >= parent.num_tokens


def test_rows_of_finished_sequences_nobody_reported_are_reclaimed_when_full():
    kv = KVCacheManager(64, BS)
    batch = InputBatch(max_num_seqs=2, max_model_len=32, block_size=BS)
    a, b = new_seq(0, [1, 2, 3]), new_seq(1, [4, 5])
    step(batch, [admit(kv, a), admit(kv, b)])
    kv.free(a)
    a.status = SequenceStatus.FINISHED_ABORTED
    step(batch, [decode(kv, b), admit(kv, new_seq(2, [6]))])
    assert batch.num_rows == 2 and 0 not in batch.row_of


def test_model_runner_prepare_keeps_the_attention_metadata_contract():
    kv = KVCacheManager(64, BS)
    runner = object.__new__(ModelRunner)  # prepare needs no model: device, block size, input batch
    runner.device, runner.block_size = torch.device("cpu"), BS
    runner.input_batch = InputBatch(4, 64, BS)
    a, b = new_seq(0, list(range(9))), new_seq(1, [1, 2, 3])
    for scheduled in ([admit(kv, a), admit(kv, b, budget=2)], None, None):
        sched = SchedulerOutput(scheduled=scheduled or [decode(kv, a), decode(kv, b)])
        want = reference_step(sched, BS)
        inp = runner.prepare(sched)
        assert isinstance(inp, ModelInput) and isinstance(inp.metadata, AttentionMetadata)
        md = inp.metadata
        got = {name: getattr(md, name) for name in ("query_start_loc", "seq_lens", "block_table", "slot_mapping",
                                                    "max_query_len", "max_seq_len", "query_start_loc_cpu",
                                                    "seq_lens_cpu", "num_tokens")}
        got.update(input_ids=inp.input_ids, positions=inp.positions, logits_indices=inp.logits_indices,
                   sample_rows=inp.sample_rows)
        assert_same(got, want)
        assert md.block_size == BS
        for seq, n in sched.scheduled:
            seq.num_computed_tokens += n
            if seq.num_computed_tokens == seq.num_tokens:
                seq.token_ids.append(3)


def test_scheduler_reports_finished_sequences_once_with_a_step_that_runs():
    cfg = EngineConfig(block_size=BS, max_num_batched_tokens=64, max_num_seqs=4)
    sched = Scheduler(cfg, KVCacheManager(32, BS))
    a, b = new_seq(0, [1, 2, 3]), new_seq(1, [4, 5])
    sched.add(a)
    sched.add(b)
    assert sched.schedule().finished_seq_ids == []
    sched.finish(a, SequenceStatus.FINISHED_ABORTED)  # abort goes through finish
    a.num_computed_tokens = 0
    b.num_computed_tokens = b.num_tokens
    b.token_ids.append(6)
    assert sched.schedule().finished_seq_ids == [0]
    sched.finish(b, SequenceStatus.FINISHED_STOPPED)
    assert sched.schedule().is_empty  # an empty step is never run: the news waits
    c = new_seq(2, [7])
    sched.add(c)
    out = sched.schedule()
    assert out.finished_seq_ids == [1] and [s for s, _ in out.scheduled] == [c]


def test_drafts_get_logits_rows_and_a_rollback_to_the_same_length_is_copied_again():
    """Speculative decoding: a sequence with d drafts gets logits at its last d + 1 tokens; after the
    rollback it may be exactly as long as before with different tokens, and its row must follow."""
    kv = KVCacheManager(64, BS)
    batch = InputBatch(max_num_seqs=4, max_model_len=64, block_size=BS)
    a, b = new_seq(0, [1, 2, 3, 4, 5]), new_seq(1, [7, 8, 9])
    step(batch, [admit(kv, a), admit(kv, b)])
    a.token_ids += [40, 41, 42]  # three drafts after the sampled token
    a.num_draft_tokens = 3
    sched = SchedulerOutput(scheduled=[decode(kv, a), decode(kv, b)])
    want = reference_step(sched, BS)
    got = batch.apply(sched)
    assert got.logits_indices.tolist() == [0, 1, 2, 3, 4]  # a's 3 drafts + 1, then b's one
    assert_same({name: getattr(got, name) for name in want if name != "logits_indices"},
                {name: w for name, w in want.items() if name != "logits_indices"})
    # two drafts accepted, the third rejected, then a new token: 9 tokens again, the last one new
    a.num_computed_tokens += 4
    kv.rewind(a, 1)
    del a.token_ids[-3:]
    a.num_draft_tokens = 0
    a.token_ids += [40, 41, 50]
    b.num_computed_tokens += 1
    b.token_ids.append(6)
    step(batch, [decode(kv, a), decode(kv, b)])  # check_step compares the rows with the sequences
    assert batch.token_ids[batch.row_of[0], 8] == 50

"""The list-based reference step the persistent input batch is checked against (test_input_batch*.py)."""

import torch

from pagedcore.input_batch import InputBatch
from pagedcore.scheduler import SchedulerOutput

BS = 4


def reference_step(sched: SchedulerOutput, block_size: int) -> dict:
    """ModelRunner.prepare before the persistent batch: everything rebuilt from Python lists."""
    input_ids: list[int] = []
    starts, q_lens, block_tables, sample_rows = [], [], [], []
    for seq, n in sched.scheduled:
        start = seq.num_computed_tokens
        input_ids.extend(seq.token_ids[start:start + n])
        starts.append(start)
        q_lens.append(n)
        block_tables.append(seq.block_table)
    seq_lens = [s + n for s, n in zip(starts, q_lens)]
    for i, (seq, _) in enumerate(sched.scheduled):
        if seq_lens[i] == seq.num_tokens:
            sample_rows.append(i)
    q_lens_t = torch.tensor(q_lens, dtype=torch.int64)
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int64)
    torch.cumsum(q_lens_t, 0, out=qsl[1:])
    offsets = torch.tensor(starts, dtype=torch.int64) - qsl[:-1]
    positions = torch.arange(qsl[-1].item()) + torch.repeat_interleave(offsets, q_lens_t)
    seq_idx = torch.repeat_interleave(torch.arange(len(q_lens)), q_lens_t)
    width = max(len(bt) for bt in block_tables)
    block_table = torch.tensor([bt + [0] * (width - len(bt)) for bt in block_tables], dtype=torch.int32)
    slot_mapping = block_table[seq_idx, positions // block_size].long() * block_size + positions % block_size
    qsl_list = qsl.tolist()
    return dict(
        input_ids=torch.tensor(input_ids), positions=positions, query_start_loc=qsl.to(torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_table=block_table, slot_mapping=slot_mapping,
        logits_indices=torch.tensor([qsl_list[i + 1] - 1 for i in sample_rows], dtype=torch.int64),
        query_start_loc_cpu=qsl_list, seq_lens_cpu=seq_lens, max_query_len=max(q_lens),
        max_seq_len=max(seq_lens), num_tokens=len(input_ids), sample_rows=sample_rows)


def assert_same(got: dict, want: dict) -> None:
    for name, w in want.items():
        g = got[name]
        if isinstance(w, torch.Tensor):
            assert g.dtype == w.dtype and g.device == w.device, (name, g.dtype, w.dtype)
            assert torch.equal(g, w), (name, g, w)
        else:
            assert type(g) is type(w) and g == w, (name, g, w)


def check_step(batch: InputBatch, sched: SchedulerOutput) -> None:
    want = reference_step(sched, BS)
    b = batch.apply(sched)
    assert_same({name: getattr(b, name) for name in want}, want)
    for seq, _ in sched.scheduled:  # the row holds the whole sequence, not just this step's slice
        row = batch.row_of[seq.seq_id]
        assert batch.token_ids[row, :seq.num_tokens].tolist() == seq.token_ids
        padding = [0] * (batch.block_table.shape[1] - len(seq.block_table))
        assert batch.block_table[row].tolist() == seq.block_table + padding

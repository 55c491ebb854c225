"""InputBatch: persistent per-sequence rows of token ids and block ids, updated by diffs (vLLM v1).

Every live sequence owns one row of two preallocated CPU arrays: its token ids and its block
table. A step applies only what changed since the last one: a sequence seen for the first time
gets a free row (its tokens and blocks are copied once); a known one appends the tokens and block
ids it gained (usually one token, now and then one block); the rows of finished and preempted
sequences are freed. Building the step's flattened batch is then a handful of vectorised gathers
over the scheduled rows, so it costs O(batch + new tokens), not O(batch x context).

How a row stays in sync with `Sequence` (see KVCacheManager for the changes it mirrors):
- token ids grow at the end, except that draft tokens (speculative decoding) are taken back after
  verification: a row remembers how many of its tokens were not drafts when it last synced
  (`num_stable`) and copies again from there, since the list may be as long as before but differ;
- a block table is either replaced by a new list (admission with prefix hits, fork, swap in,
  free on recompute preemption), grows at the end, or has its last block replaced in place
  (copy-on-write of a shared partial block). The row remembers the list it copied and its last
  block id; a different list or a different last block means the whole table is copied again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from pagedcore.kv_cache_manager import cdiv

if TYPE_CHECKING:
    from pagedcore.scheduler import SchedulerOutput
    from pagedcore.sequence import Sequence


@dataclass
class StepInputs:
    """One step's flattened batch on the CPU: B scheduled sequences, T new tokens
    (the fields of `AttentionMetadata`, plus what the model and the sampler need)."""

    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    query_start_loc: torch.Tensor  # int32 [B + 1]
    seq_lens: torch.Tensor  # int32 [B]
    block_table: torch.Tensor  # int32 [B, max blocks of the batch], 0 past each sequence's last block
    slot_mapping: torch.Tensor  # int64 [T]
    logits_indices: torch.Tensor  # int64: the tokens whose logits are sampled
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    max_query_len: int
    max_seq_len: int
    sample_rows: list[int]  # which scheduled sequences sample this step
    num_prompt_tokens_cpu: list[int] | None = None

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc_cpu[-1]

    def advance(self, token_ids: np.ndarray, block_size: int) -> None:
        """In place, the next step of a decode-only batch (multi-step decode): each row's new token as its input,
        one position on, its slot from the block table (which must already hold it: the scheduler reserved it).
        Numpy on the step's own arrays: each torch op would cost ~20 us with the caches cold after a forward."""
        self.input_ids.numpy()[:] = token_ids
        pos = self.positions.numpy()
        pos += 1
        self.seq_lens.numpy()[:] += 1
        blocks = self.block_table.numpy()[np.arange(len(pos)), pos // block_size]
        np.add(blocks * block_size, pos % block_size, out=self.slot_mapping.numpy())
        self.seq_lens_cpu = [n + 1 for n in self.seq_lens_cpu]
        self.max_seq_len += 1


class InputBatch:
    def __init__(self, max_num_seqs: int, max_model_len: int, block_size: int):
        """Rows for `max_num_seqs` sequences of up to `max_model_len` tokens; both grow on demand
        (forked samples may outnumber max_num_seqs). Token rows are `np.empty`: memory is touched
        only as far as sequences actually reach."""
        self.block_size = block_size
        self.token_ids = np.empty((max_num_seqs, max_model_len), dtype=np.int32)
        self.block_table = np.zeros((max_num_seqs, cdiv(max_model_len, block_size)), dtype=np.int32)
        # Per row: what it holds, and the lists it was copied from (to notice replacements).
        self.num_tokens = [0] * max_num_seqs
        self.num_stable = [0] * max_num_seqs  # tokens that were not drafts at the last sync
        self.num_blocks = [0] * max_num_seqs
        self.last_block = [-1] * max_num_seqs
        self.owner: list[Sequence | None] = [None] * max_num_seqs
        self.token_src: list[list[int] | None] = [None] * max_num_seqs
        self.block_src: list[list[int] | None] = [None] * max_num_seqs
        self.row_of: dict[int, int] = {}  # seq_id -> row
        self.free_rows = list(range(max_num_seqs - 1, -1, -1))  # popped from the end: low rows first

    @property
    def num_rows(self) -> int:
        return len(self.owner)

    # ---- the diff ------------------------------------------------------------------------------
    def apply(self, sched: SchedulerOutput) -> StepInputs:
        """Free the rows of sequences that left, bring the scheduled ones up to date, build the step."""
        for seq_id in sched.finished_seq_ids:
            self.free(seq_id)
        for seq in sched.preempted:
            self.free(seq.seq_id)
        return self._build(sched, [self.sync(seq) for seq, _ in sched.scheduled])

    def sync(self, seq: Sequence) -> int:
        """The sequence's row, holding all its tokens and its current block table."""
        row = self.row_of.get(seq.seq_id)
        if row is None or self.owner[row] is not seq:
            row = self._add(seq)
        tokens, blocks = seq.token_ids, seq.block_table
        if self.num_stable[row] < self.num_tokens[row]:  # drafts since: maybe replaced, same length
            self.num_tokens[row] = self.num_stable[row]
        if len(tokens) != self.num_tokens[row] or tokens is not self.token_src[row]:
            self._sync_tokens(row, tokens)
        self.num_stable[row] = len(tokens) - seq.num_draft_tokens
        if len(blocks) != self.num_blocks[row] or blocks is not self.block_src[row] \
                or (blocks and blocks[-1] != self.last_block[row]):
            self._sync_blocks(row, blocks)
        return row

    def _sync_tokens(self, row: int, tokens: list[int]) -> None:
        if tokens is not self.token_src[row]:
            self.token_src[row], self.num_tokens[row] = tokens, 0
        held, n = min(self.num_tokens[row], len(tokens)), len(tokens)
        if n > self.token_ids.shape[1]:
            self._grow(cols=n)
        if n == held + 1:
            self.token_ids[row, held] = tokens[held]
        else:
            self.token_ids[row, held:n] = tokens[held:n]
        self.num_tokens[row] = n

    def _sync_blocks(self, row: int, blocks: list[int]) -> None:
        held, m = self.num_blocks[row], len(blocks)
        if m > self.block_table.shape[1]:
            self._grow(block_cols=m)
        bt = self.block_table[row]
        if blocks is self.block_src[row] and m > held and (held == 0 or blocks[held - 1] == self.last_block[row]):
            bt[held:m] = blocks[held:m]  # grew at the end
        else:  # replaced, or its last block copied on write: copy it whole
            if held > m:
                bt[m:held] = 0
            bt[:m] = blocks
            self.block_src[row] = blocks
        self.num_blocks[row] = m
        self.last_block[row] = blocks[-1] if m else -1

    def free(self, seq_id: int) -> None:
        row = self.row_of.pop(seq_id, None)
        if row is None:
            return
        self.block_table[row, :self.num_blocks[row]] = 0  # rows are zero past their blocks
        self.num_tokens[row] = self.num_blocks[row] = self.num_stable[row] = 0
        self.last_block[row] = -1
        self.owner[row] = self.token_src[row] = self.block_src[row] = None
        self.free_rows.append(row)

    def _add(self, seq: Sequence) -> int:
        self.free(seq.seq_id)  # a different Sequence object under a reused id
        if not self.free_rows:
            # Rows of sequences finished without being reported; else make room.
            for other in [s for s in self.owner if s is not None and s.is_finished]:
                self.free(other.seq_id)
            if not self.free_rows:
                self._grow(rows=2 * self.num_rows)
        row = self.free_rows.pop()
        self.row_of[seq.seq_id] = row
        self.owner[row] = seq
        return row

    def _grow(self, rows: int = 0, cols: int = 0, block_cols: int = 0) -> None:
        old_rows, old_cols = self.token_ids.shape
        new_rows = max(rows, old_rows)
        new_cols = max(cols, old_cols) if cols <= old_cols else max(cols, 2 * old_cols)
        old_bcols = self.block_table.shape[1]
        new_bcols = max(block_cols, old_bcols, cdiv(new_cols, self.block_size))
        tokens = np.empty((new_rows, new_cols), dtype=np.int32)
        tokens[:old_rows, :old_cols] = self.token_ids
        table = np.zeros((new_rows, new_bcols), dtype=np.int32)
        table[:old_rows, :old_bcols] = self.block_table
        self.token_ids, self.block_table = tokens, table
        extra = new_rows - old_rows
        if extra:
            self.num_tokens += [0] * extra
            self.num_stable += [0] * extra
            self.num_blocks += [0] * extra
            self.last_block += [-1] * extra
            self.owner += [None] * extra
            self.token_src += [None] * extra
            self.block_src += [None] * extra
            self.free_rows = list(range(new_rows - 1, old_rows - 1, -1)) + self.free_rows

    # ---- the step's flattened batch --------------------------------------------------------------
    def _build(self, sched: SchedulerOutput, rows: list[int]) -> StepInputs:
        # O(batch) Python for the per-sequence numbers, then O(tokens) numpy gathers.
        starts, seq_lens, qsl, sample_rows, num_logits, prompt_lens = [], [], [0], [], [], []
        width = max_query_len = 0
        for i, ((seq, n), row) in enumerate(zip(sched.scheduled, rows)):
            start = seq.num_computed_tokens
            starts.append(start)
            seq_lens.append(start + n)
            qsl.append(qsl[-1] + n)
            prompt_lens.append(seq.num_prompt_tokens)
            if start + n == len(seq.token_ids):  # this chunk reaches the end: a new token is sampled
                sample_rows.append(i)
                num_logits.append(1 + seq.num_draft_tokens)  # verification: a row per draft, + 1
            width = max(width, self.num_blocks[row])
            max_query_len = max(max_query_len, n)
        num_seqs, num_tokens = len(rows), qsl[-1]
        rows_np = np.array(rows, dtype=np.int64)
        qsl_np = np.array(qsl, dtype=np.int64)
        if num_tokens == num_seqs:  # all decodes: one token per sequence
            token_rows = rows_np
            seq_idx = np.arange(num_seqs)
            positions = np.array(starts, dtype=np.int64)
        else:
            seq_idx = np.repeat(np.arange(num_seqs), np.diff(qsl_np))
            token_rows = rows_np[seq_idx]
            # position of token t = start of its sequence + its offset inside the sequence's chunk
            offsets = np.array(starts, dtype=np.int64) - qsl_np[:-1]
            positions = np.arange(num_tokens) + offsets[seq_idx]
        input_ids = self.token_ids[token_rows, positions].astype(np.int64)
        block_table = self.block_table[rows_np, :width]
        bs = self.block_size
        slot_mapping = block_table[seq_idx, positions // bs].astype(np.int64) * bs + positions % bs
        logits_indices = qsl_np[np.array(sample_rows, dtype=np.int64) + 1] - 1
        if sum(num_logits) > len(sample_rows):
            # the last 1 + d tokens of each sampling sequence with d drafts
            counts = np.array(num_logits, dtype=np.int64)
            firsts = np.repeat(logits_indices - counts + 1, counts)
            logits_indices = firsts + np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
        return StepInputs(
            input_ids=torch.from_numpy(input_ids),
            positions=torch.from_numpy(positions),
            query_start_loc=torch.from_numpy(qsl_np.astype(np.int32)),
            seq_lens=torch.from_numpy(np.array(seq_lens, dtype=np.int32)),
            block_table=torch.from_numpy(block_table),
            slot_mapping=torch.from_numpy(slot_mapping),
            logits_indices=torch.from_numpy(logits_indices),
            query_start_loc_cpu=qsl,
            seq_lens_cpu=seq_lens,
            max_query_len=max_query_len,
            max_seq_len=max(seq_lens),
            sample_rows=sample_rows,
            num_prompt_tokens_cpu=prompt_lens,
        )

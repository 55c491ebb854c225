"""KVCacheManager: per-sequence block tables over the BlockPool (allocate, fork, copy-on-write, free)."""

from __future__ import annotations

from pagedcore.block_pool import BlockPool
from pagedcore.sequence import Sequence


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        # (src, dst) block copies the runner must do before the next forward pass.
        self.pending_copies: list[tuple[int, int]] = []

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def num_blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        needed = cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size) - len(seq.block_table)
        return max(needed, 0) + int(self._last_block_needs_copy(seq, num_new_tokens))

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Make room for `num_new_tokens` more KV entries; False (and no change) if blocks are short."""
        if self.num_blocks_needed(seq, num_new_tokens) > self.pool.num_free_blocks:
            return False
        if self._last_block_needs_copy(seq, num_new_tokens):
            self._copy_on_write_last_block(seq)
        missing = cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size) - len(seq.block_table)
        if missing > 0:
            seq.block_table.extend(self.pool.get_new_blocks(missing))
        return True

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Child shares every block of the parent; writes into a shared block copy it first."""
        assert not child.block_table
        self.pool.incref(parent.block_table)
        child.block_table = list(parent.block_table)
        child.num_computed_tokens = parent.num_computed_tokens

    def free(self, seq: Sequence) -> None:
        # Tail first, so blocks least likely to be shared are reused last-in first.
        self.pool.free_blocks(reversed(seq.block_table))
        seq.block_table = []
        seq.num_computed_tokens = 0

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def _last_block_needs_copy(self, seq: Sequence, num_new_tokens: int) -> bool:
        # Only a partly filled, shared last block is ever written to in place.
        if num_new_tokens == 0 or seq.num_computed_tokens % self.block_size == 0 or not seq.block_table:
            return False
        last = seq.block_table[(seq.num_computed_tokens - 1) // self.block_size]
        return self.pool.ref_counts[last] > 1

    def _copy_on_write_last_block(self, seq: Sequence) -> None:
        i = (seq.num_computed_tokens - 1) // self.block_size
        src = seq.block_table[i]
        (dst,) = self.pool.get_new_blocks(1)
        self.pool.free_blocks([src])
        seq.block_table[i] = dst
        self.pending_copies.append((src, dst))

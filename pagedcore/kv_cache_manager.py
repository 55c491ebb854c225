"""KVCacheManager: per-sequence block tables over the BlockPool.

allocate, fork (share every block), copy-on-write of a shared partial last block, free, rewind
(rejected draft tokens), prefix reuse (longest cached run of full blocks, identified by chained
hashes), and swap to a second (CPU) pool.
"""

from __future__ import annotations

from pagedcore.block_pool import BlockPool
from pagedcore.sequence import Sequence


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def hash_block(parent_hash: int | None, token_ids: tuple[int, ...], extra: object = None) -> int:
    """Chained over the previous block, so equal blocks after different prefixes never match."""
    return hash((parent_hash, token_ids, extra))


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 num_cpu_blocks: int = 0):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self.cpu_pool = BlockPool(num_cpu_blocks) if num_cpu_blocks > 0 else None
        # (src, dst) block copies the runner must do before the next forward pass.
        self.pending_copies: list[tuple[int, int]] = []
        self.num_prefix_hit_tokens = 0
        self.num_prefix_query_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    # ---- allocation ----------------------------------------------------------------------
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

    def allocate_new_sequence(self, seq: Sequence, budget: int, allow_chunking: bool) -> int | None:
        """First allocation of a waiting sequence: reuse its longest cached prefix, then make room
        for up to `budget` more tokens. Returns the number of tokens to compute, or None."""
        if seq.block_table or seq.num_computed_tokens:
            raise RuntimeError(f"sequence {seq.seq_id} already holds blocks or computed tokens")
        hits = self.find_cached_prefix(seq)
        num_cached = len(hits) * self.block_size
        num_new = seq.num_tokens - num_cached
        if num_new > budget and not allow_chunking:
            return None
        num_new = min(num_new, budget)
        needed = cdiv(num_cached + num_new, self.block_size) - len(hits)
        hits_now_free = sum(self.pool.ref_counts[b] == 0 for b in hits)
        if needed + hits_now_free > self.pool.num_free_blocks:
            return None
        self.pool.touch(hits)
        seq.block_table = hits + self.pool.get_new_blocks(needed)
        seq.num_computed_tokens = num_cached
        seq.num_cached_tokens = num_cached
        self.num_prefix_hit_tokens += num_cached
        self.num_prefix_query_tokens += seq.num_tokens
        return num_new

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Child shares every block of the parent; writes into a shared block copy it first."""
        if child.block_table:
            raise RuntimeError(f"fork into sequence {child.seq_id}, which already holds blocks")
        self.pool.incref(parent.block_table)
        child.block_table = list(parent.block_table)
        child.num_computed_tokens = parent.num_computed_tokens
        child.block_hashes = list(parent.block_hashes)
        child.num_published_blocks = parent.num_published_blocks

    def free(self, seq: Sequence) -> None:
        # Tail first: in the LRU free queue the tail of a sequence is evicted before its prefix.
        self.pool.free_blocks(reversed(seq.block_table))
        if seq.cpu_block_table:
            self.cpu_pool.free_blocks(seq.cpu_block_table)
            seq.cpu_block_table = []
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_published_blocks = 0

    def rewind(self, seq: Sequence, num_tokens: int) -> None:
        """Forget the KV of the last `num_tokens` computed tokens (rejected draft tokens): blocks
        left holding none of the kept tokens return to the pool."""
        if not 0 <= num_tokens <= seq.num_computed_tokens:
            raise ValueError(f"cannot rewind {num_tokens} of {seq.num_computed_tokens} computed tokens")
        seq.num_computed_tokens -= num_tokens
        keep = cdiv(seq.num_computed_tokens, self.block_size)
        self.pool.free_blocks(reversed(seq.block_table[keep:]))
        del seq.block_table[keep:]
        num_full = seq.num_computed_tokens // self.block_size
        del seq.block_hashes[num_full:]  # later ones may hash rejected tokens
        seq.num_published_blocks = min(seq.num_published_blocks, num_full)

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    # ---- prefix caching --------------------------------------------------------------------
    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids of the longest run of cached full blocks from the start of the sequence.
        At least one token is always left to compute: its logits are needed."""
        if not self.pool.enable_caching:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        self._extend_block_hashes(seq, max_blocks)
        hits = []
        for h in seq.block_hashes[:max_blocks]:
            block = self.pool.lookup(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Publish the blocks this sequence has completely computed since the last call."""
        if not self.pool.enable_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        if num_full <= seq.num_published_blocks:
            return
        self._extend_block_hashes(seq, num_full)
        for i in range(seq.num_published_blocks, num_full):
            self.pool.cache_block(seq.block_table[i], seq.block_hashes[i])
        seq.num_published_blocks = num_full

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()

    def _extend_block_hashes(self, seq: Sequence, num_blocks: int) -> None:
        bs = self.block_size
        for i in range(len(seq.block_hashes), num_blocks):
            parent = seq.block_hashes[i - 1] if i else None
            seq.block_hashes.append(hash_block(parent, tuple(seq.token_ids[i * bs:(i + 1) * bs]), seq.cache_salt))

    # ---- swap --------------------------------------------------------------------------------
    def can_swap_out(self, seq: Sequence) -> bool:
        return self.cpu_pool is not None and self.cpu_pool.num_free_blocks >= len(seq.block_table)

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]]:
        """Move the sequence's blocks to the CPU pool; returns (device block, cpu block) copies."""
        cpu = self.cpu_pool.get_new_blocks(len(seq.block_table))
        mapping = list(zip(seq.block_table, cpu))
        self.pool.free_blocks(reversed(seq.block_table))
        seq.block_table, seq.cpu_block_table = [], cpu
        return mapping

    def can_swap_in(self, seq: Sequence, num_new_tokens: int) -> bool:
        blocks = max(len(seq.cpu_block_table), cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size))
        return blocks <= self.pool.num_free_blocks

    def swap_in(self, seq: Sequence) -> list[tuple[int, int]]:
        """Bring the sequence back; returns (cpu block, device block) copies."""
        dev = self.pool.get_new_blocks(len(seq.cpu_block_table))
        mapping = list(zip(seq.cpu_block_table, dev))
        self.cpu_pool.free_blocks(seq.cpu_block_table)
        seq.block_table, seq.cpu_block_table = dev, []
        seq.num_published_blocks = 0  # new physical blocks: publish them again
        return mapping

    # ---- copy-on-write -------------------------------------------------------------------
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

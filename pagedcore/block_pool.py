"""BlockPool: the KV cache's physical blocks, their ref counts, the free queue and the prefix cache.

A block is free iff its ref count is 0. A free block may still hold a cached full block (its
hash is in `cached_blocks`): it stays reusable until the free queue hands it out again, so the
free queue doubles as the LRU eviction order (least recently freed first).
"""

from __future__ import annotations

from collections import OrderedDict


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = False):
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_counts = [0] * num_blocks
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.block_hashes: list[int | None] = [None] * num_blocks
        self.cached_blocks: dict[int, int] = {}  # block hash -> block id
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def free_block_ids(self) -> list[int]:
        return list(self.free_queue)

    def get_new_blocks(self, n: int) -> list[int]:
        if n > len(self.free_queue):
            raise RuntimeError(f"asked for {n} blocks, {len(self.free_queue)} free")
        ids = [self.free_queue.popitem(last=False)[0] for _ in range(n)]
        for b in ids:
            self._evict(b)
            self.ref_counts[b] = 1
        return ids

    def incref(self, block_ids) -> None:
        for b in block_ids:
            if self.ref_counts[b] <= 0:
                raise RuntimeError(f"incref of free block {b}")
            self.ref_counts[b] += 1

    def touch(self, block_ids) -> None:
        """Take a reference on cached blocks found by a prefix hit (free ones leave the queue)."""
        for b in block_ids:
            if self.ref_counts[b] == 0:
                del self.free_queue[b]
            self.ref_counts[b] += 1

    def free_blocks(self, block_ids) -> None:
        """Drop one reference from each block; blocks reaching zero go to the end of the free queue."""
        for b in block_ids:
            if self.ref_counts[b] <= 0:
                raise RuntimeError(f"double free of block {b}")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self.free_queue[b] = None

    def cache_block(self, block_id: int, block_hash: int) -> None:
        """Publish a full block under its hash; first come keeps the entry."""
        if not self.enable_caching or block_hash in self.cached_blocks or self.block_hashes[block_id] is not None:
            return
        self.block_hashes[block_id] = block_hash
        self.cached_blocks[block_hash] = block_id

    def lookup(self, block_hash: int) -> int | None:
        return self.cached_blocks.get(block_hash)

    def reset_prefix_cache(self) -> None:
        for b, h in enumerate(self.block_hashes):
            if h is not None:
                self._evict(b)

    def _evict(self, block_id: int) -> None:
        h = self.block_hashes[block_id]
        if h is not None:
            del self.cached_blocks[h]
            self.block_hashes[block_id] = None
            self.num_evictions += 1

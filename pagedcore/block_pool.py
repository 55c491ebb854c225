"""BlockPool: the KV cache's physical blocks, their ref counts and the free list."""

from __future__ import annotations

from collections import deque


class BlockPool:
    """Owns block ids 0..num_blocks-1. A block is free iff its ref count is 0."""

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.free_block_ids: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def get_new_blocks(self, n: int) -> list[int]:
        if n > len(self.free_block_ids):
            raise RuntimeError(f"asked for {n} blocks, {len(self.free_block_ids)} free")
        ids = [self.free_block_ids.popleft() for _ in range(n)]
        for b in ids:
            self.ref_counts[b] = 1
        return ids

    def incref(self, block_ids: list[int]) -> None:
        for b in block_ids:
            assert self.ref_counts[b] > 0, f"incref of free block {b}"
            self.ref_counts[b] += 1

    def free_blocks(self, block_ids: list[int]) -> None:
        """Drop one reference from each block; blocks reaching zero go back on the free list."""
        for b in block_ids:
            assert self.ref_counts[b] > 0, f"double free of block {b}"
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self.free_block_ids.append(b)

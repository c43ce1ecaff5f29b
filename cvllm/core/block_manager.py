"""Paged KV cache bookkeeping: which block ids are free, and how many users each has.

Built by ``engine/`` on rank 0 once the worker has sized the KV cache
(``CacheConfig.num_blocks``), owned by the ``Scheduler``. Lives on rank 0 only: other
ranks never allocate, they write KV wherever ``StepInput.slot_mapping`` says.

Blocks carry reference counts so that prefix caching can share full blocks between
sequences later; today every block has one owner. Any inconsistency (double free, a block
id out of range) raises ``BlockManagerError`` before anything is changed, so a bug never
silently corrupts the free list.
"""

from __future__ import annotations

import numbers
from collections import deque
from typing import Iterable, List

from cvllm.core.sequence import Sequence


class BlockManagerError(AssertionError):
    """The block bookkeeping was asked to do something impossible (a bug in the caller)."""


class NoFreeBlocksError(RuntimeError):
    """``allocate`` was called without enough free blocks; check ``can_allocate`` first."""


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self._num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts: List[int] = [0] * num_blocks

    @property
    def num_total_blocks(self) -> int:
        return self._num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, for metrics."""
        return 1.0 - len(self._free) / self._num_blocks

    def ref_count(self, block_id: int) -> int:
        self._check_id(block_id)
        return self._ref_counts[block_id]

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Extra blocks so seq.block_ids covers num_computed_tokens + num_new_tokens."""
        total = self.blocks_for_tokens(seq.num_computed_tokens + num_new_tokens)
        return max(0, total - len(seq.block_ids))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.blocks_needed(seq, num_new_tokens) <= len(self._free)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> List[int]:
        """Append fresh blocks to seq.block_ids; returns the new ids."""
        n = self.blocks_needed(seq, num_new_tokens)
        if n > len(self._free):
            raise NoFreeBlocksError(
                f"sequence {seq.seq_id} needs {n} blocks for {num_new_tokens} new tokens, "
                f"only {len(self._free)} of {self._num_blocks} are free"
            )
        new = [self._free.popleft() for _ in range(n)]
        for b in new:
            self._ref_counts[b] = 1
        seq.block_ids.extend(new)
        return new

    def share(self, seq: Sequence, block_ids: Iterable[int]) -> None:
        """Append blocks already owned by others (prefix-cache hits) to seq, bumping refs."""
        block_ids = list(block_ids)
        for b in block_ids:
            self._check_id(b)
            if self._ref_counts[b] < 1:
                raise BlockManagerError(f"cannot share free block {b}")
        for b in block_ids:
            self._ref_counts[b] += 1
        seq.block_ids.extend(block_ids)

    def free(self, seq: Sequence) -> None:
        """Drop seq's reference on each of its blocks; blocks nobody uses become free."""
        self.free_blocks(seq.block_ids)
        seq.block_ids = []

    def free_blocks(self, block_ids: Iterable[int]) -> None:
        block_ids = list(block_ids)
        # Validate everything first so a bad list leaves the free list untouched.
        drops: dict[int, int] = {}
        for b in block_ids:
            self._check_id(b)
            drops[b] = drops.get(b, 0) + 1
        for b, n in drops.items():
            if self._ref_counts[b] < n:
                raise BlockManagerError(
                    f"double free of block {b}: ref count {self._ref_counts[b]}, freeing {n}"
                )
        # Tail blocks first: once prefix caching lands, the least useful blocks are reused first.
        for b in reversed(block_ids):
            self._ref_counts[b] -= 1
            if self._ref_counts[b] == 0:
                self._free.append(b)

    def _check_id(self, block_id: int) -> None:
        if not isinstance(block_id, numbers.Integral) or not 0 <= block_id < self._num_blocks:
            raise BlockManagerError(f"unknown block id {block_id!r} (cache has {self._num_blocks})")

"""Paged KV cache bookkeeping of one KV cache group: which block ids are free, and how
many users each has.

Built by ``engine/`` on rank 0 once the worker has sized the KV cache (one per group of
``KVCacheLayout``, held by the ``KVCacheManager``), owned by the ``Scheduler``. Lives on
rank 0 only: other ranks never allocate, they write KV wherever ``StepInput.slot_mapping``
says. A manager works on ``seq.group_block_ids(self.group)``.

A sliding-window group (``sliding_window`` set) frees, after each step, the blocks that
no future query can attend to (``remove_out_of_window_blocks``); their entries in the
sequence's list become ``PLACEHOLDER_BLOCK`` so list index = position // block_size still
holds. Placeholders always form a prefix of the list.

Blocks carry reference counts so that prefix caching can share full blocks between
sequences later; today every block has one owner. Any inconsistency (double free, a block
id out of range) raises ``BlockManagerError`` before anything is changed, so a bug never
silently corrupts the free list.
"""

from __future__ import annotations

import numbers
from collections import deque
from typing import Iterable, List, Optional

from cvllm.core.sequence import Sequence

PLACEHOLDER_BLOCK = -1
"""Block-table entry of a freed out-of-window block: never read (the attention mask
excludes its positions); the device metadata clamps it to block 0."""


class BlockManagerError(AssertionError):
    """The block bookkeeping was asked to do something impossible (a bug in the caller)."""


class NoFreeBlocksError(RuntimeError):
    """``allocate`` was called without enough free blocks; check ``can_allocate`` first."""


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def max_live_blocks(num_tokens: int, max_chunk: int, block_size: int,
                    sliding_window: Optional[int]) -> int:
    """Most blocks one sequence of ``num_tokens`` tokens holds at once when it is given at
    most ``max_chunk`` new tokens a step. Full attention keeps every block. A sliding
    group keeps the window behind the first query plus the chunk: with ``c`` tokens
    computed and ``n`` new ones the live blocks run from ``(c - W + 1) // bs`` to
    ``(c + n - 1) // bs``, at most ``ceil((W - 1 + n) / bs) + 1`` of them."""
    full = cdiv(num_tokens, block_size)
    if sliding_window is None:
        return full
    chunk = max(1, min(max_chunk, num_tokens))
    return min(full, cdiv(sliding_window - 1 + chunk, block_size) + 1)


class BlockManager:
    def __init__(
        self, num_blocks: int, block_size: int, sliding_window: Optional[int] = None,
        group: int = 0,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
        if group < 0:
            raise ValueError(f"group must be >= 0, got {group}")
        self.block_size = block_size
        self.sliding_window = sliding_window
        """Tokens a query attends back to (HF semantics: keys ``p - W < j <= p``); None
        for full attention (and MLA)."""
        self.group = group
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
        """Extra blocks so seq's list covers num_computed_tokens + num_new_tokens."""
        total = self.blocks_for_tokens(seq.num_computed_tokens + num_new_tokens)
        return max(0, total - len(seq.group_block_ids(self.group)))

    def max_blocks_per_seq(self, num_tokens: int, max_chunk: int) -> int:
        """Most blocks one sequence of ``num_tokens`` tokens ever holds at once in this
        group (see ``max_live_blocks``)."""
        return max_live_blocks(num_tokens, max_chunk, self.block_size, self.sliding_window)

    def num_live_blocks(self, seq: Sequence) -> int:
        """Blocks seq holds in this group (placeholders excluded)."""
        return sum(1 for b in seq.group_block_ids(self.group) if b != PLACEHOLDER_BLOCK)

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
        seq.group_block_ids(self.group).extend(new)
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
        seq.group_block_ids(self.group).extend(block_ids)

    def free(self, seq: Sequence) -> None:
        """Drop seq's reference on each of its blocks; blocks nobody uses become free."""
        ids = seq.group_block_ids(self.group)
        self.free_blocks([b for b in ids if b != PLACEHOLDER_BLOCK])
        seq.block_ids_by_group[self.group] = []

    def remove_out_of_window_blocks(self, seq: Sequence) -> List[int]:
        """Free seq's blocks that lie wholly before the oldest key any future query can
        see, replacing them with placeholders; returns the freed ids (none for a full
        group). Call only once the step that computed ``num_computed_tokens`` has finished
        on every rank (DESIGN rule 8). The next query sits at position
        ``c = num_computed_tokens`` and sees keys ``> c - W``, so block ``i`` (positions
        ``i*bs .. (i+1)*bs - 1``) is dead once ``(i + 1) * bs <= c - W + 1``."""
        if self.sliding_window is None:
            return []
        ids = seq.group_block_ids(self.group)
        num_dead = min(len(ids), max(0, seq.num_computed_tokens - self.sliding_window + 1)
                       // self.block_size)
        # Placeholders form a prefix: walk back from the last dead block to the first one.
        i = num_dead - 1
        while i >= 0 and ids[i] != PLACEHOLDER_BLOCK:
            i -= 1
        freed = ids[i + 1:num_dead]
        self.free_blocks(freed)
        ids[i + 1:num_dead] = [PLACEHOLDER_BLOCK] * len(freed)
        return freed

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

"""Paged KV cache bookkeeping of one KV cache group: which block ids are free, how many
users each has, and (prefix caching) which full blocks hold whose content.

Built by ``engine/`` on rank 0 once the worker has sized the KV cache (one per group of
``KVCacheLayout``, held by the ``KVCacheManager``), owned by the ``Scheduler``. Lives on
rank 0 only: other ranks never allocate, they write KV wherever ``StepInput.slot_mapping``
says. A manager works on ``seq.group_block_ids(self.group)``.

A sliding-window group (``sliding_window`` set) frees, after each step, the blocks that
no future query can attend to (``remove_out_of_window_blocks``); their entries in the
sequence's list become ``PLACEHOLDER_BLOCK`` so list index = position // block_size still
holds. Placeholders always form a prefix of the list.

Prefix caching (``enable_caching``; vLLM v1's block pool): a full block whose tokens are
final and whose K/V is computed (or being computed by a step already scheduled) is
registered under its content key (``cache_blocks``; keys from ``core/prefix_cache.py``),
and a later sequence with the same prefix takes it by reference (``share``). Every block
is in exactly one of three states:

- free: reference count 0, no key (``_free``, FIFO);
- cached: reference count 0 with a key (``_evictable``, least recently used first):
  still holding a prefix someone may hit, yet free for allocation;
- used: reference count >= 1 (with or without a key).

``allocate`` takes free blocks first and evicts the least recently used cached block only
when none are left, so ``num_free_blocks`` (what admission checks) counts both. A freed
sequence's blocks become cached tail first, so its last blocks (useful only together with
the earlier ones) are evicted first. ``max_cached_blocks`` caps the cached state
(``--prefix-cache-max-tokens``). Any inconsistency (double free, a block id out of range)
raises ``BlockManagerError`` before anything is changed, so a bug never silently
corrupts the free lists.
"""

from __future__ import annotations

import numbers
from collections import OrderedDict, deque
from typing import Dict, Iterable, List, Optional

from cvllm.core.prefix_cache import BlockHash
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
        group: int = 0, enable_caching: bool = False, max_cached_blocks: Optional[int] = None,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
        if group < 0:
            raise ValueError(f"group must be >= 0, got {group}")
        if max_cached_blocks is not None and max_cached_blocks < 0:
            raise ValueError(f"max_cached_blocks must be >= 0 or None, got {max_cached_blocks}")
        self.block_size = block_size
        self.sliding_window = sliding_window
        """Tokens a query attends back to (HF semantics: keys ``p - W < j <= p``); None
        for full attention (and MLA)."""
        self.group = group
        self.enable_caching = enable_caching
        self.max_cached_blocks = max_cached_blocks
        """Most blocks kept in the cached state (None: as many as there are)."""
        self._num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._ref_counts: List[int] = [0] * num_blocks
        self._hash_of: List[Optional[BlockHash]] = [None] * num_blocks
        self._block_of: Dict[BlockHash, int] = {}
        self._num_examined: Dict[int, int] = {}
        """seq_id -> how many of its leading blocks ``cache_blocks`` has looked at."""

    @property
    def num_total_blocks(self) -> int:
        return self._num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: free ones plus cached ones nobody uses."""
        return len(self._free) + len(self._evictable)

    @property
    def num_plain_free_blocks(self) -> int:
        """Free blocks that hold no cached prefix (taken before any cached one)."""
        return len(self._free)

    @property
    def num_cached_free_blocks(self) -> int:
        """Blocks nobody uses that hold a cached prefix (evicted only when needed)."""
        return len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self._num_blocks - len(self._free) - len(self._evictable)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, for metrics."""
        return self.num_used_blocks / self._num_blocks

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
        return self.blocks_needed(seq, num_new_tokens) <= self.num_free_blocks

    def can_allocate_after_hit(self, hit_blocks: List[int], num_tokens: int) -> bool:
        """Whether a sequence that takes ``hit_blocks`` (a prefix hit) can then get blocks
        for ``num_tokens`` tokens in all: cached blocks it revives stop being free."""
        revived = sum(1 for b in hit_blocks if b != PLACEHOLDER_BLOCK and not self._ref_counts[b])
        fresh = self.blocks_for_tokens(num_tokens) - len(hit_blocks)
        return fresh + revived <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int) -> List[int]:
        """Append fresh blocks to seq.block_ids; returns the new ids."""
        n = self.blocks_needed(seq, num_new_tokens)
        if n > self.num_free_blocks:
            raise NoFreeBlocksError(
                f"sequence {seq.seq_id} needs {n} blocks for {num_new_tokens} new tokens, "
                f"only {self.num_free_blocks} of {self._num_blocks} are free"
            )
        new = [self._take_free() for _ in range(n)]
        for b in new:
            self._ref_counts[b] = 1
        seq.group_block_ids(self.group).extend(new)
        return new

    def share(self, seq: Sequence, block_ids: Iterable[int]) -> None:
        """Append blocks others own or the cache holds (prefix hits) to seq, bumping refs.
        A sliding group's hit may start with placeholders (blocks before the window)."""
        block_ids = list(block_ids)
        for b in block_ids:
            if b == PLACEHOLDER_BLOCK and self.sliding_window is not None:
                continue
            self._check_id(b)
            if self._ref_counts[b] < 1 and b not in self._evictable:
                raise BlockManagerError(f"cannot share free block {b}")
        for b in block_ids:
            if b == PLACEHOLDER_BLOCK:
                continue
            if self._ref_counts[b] == 0:
                del self._evictable[b]
            self._ref_counts[b] += 1
        seq.group_block_ids(self.group).extend(block_ids)

    def free(self, seq: Sequence) -> None:
        """Drop seq's reference on each of its blocks; blocks nobody uses become free
        (or cached, when they hold a registered prefix)."""
        ids = seq.group_block_ids(self.group)
        self.free_blocks([b for b in ids if b != PLACEHOLDER_BLOCK])
        seq.block_ids_by_group[self.group] = []
        self._num_examined.pop(seq.seq_id, None)

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
        # Validate everything first so a bad list leaves the free lists untouched.
        drops: dict[int, int] = {}
        for b in block_ids:
            self._check_id(b)
            drops[b] = drops.get(b, 0) + 1
        for b, n in drops.items():
            if self._ref_counts[b] < n:
                raise BlockManagerError(
                    f"double free of block {b}: ref count {self._ref_counts[b]}, freeing {n}"
                )
        # Tail blocks first: they are then the first cached blocks to be evicted.
        for b in reversed(block_ids):
            self._ref_counts[b] -= 1
            if self._ref_counts[b] == 0:
                self._release(b)

    # ----- prefix cache ------------------------------------------------------------------

    def cache_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Register seq's full blocks within its first ``num_tokens`` tokens under their
        keys (``seq.block_hashes``, already extended that far). The caller vouches that
        those tokens are final and that their K/V is computed or being computed by a step
        that runs before any later one. A block whose content another block already holds
        stays unregistered (and becomes plainly free when released)."""
        if not self.enable_caching:
            return
        ids = seq.group_block_ids(self.group)
        full = min(num_tokens // self.block_size, len(ids), len(seq.block_hashes))
        start = self._num_examined.get(seq.seq_id, 0)
        for i in range(start, full):
            b, h = ids[i], seq.block_hashes[i]
            if b == PLACEHOLDER_BLOCK or self._hash_of[b] is not None or h in self._block_of:
                continue
            self._hash_of[b] = h
            self._block_of[h] = b
        self._num_examined[seq.seq_id] = max(start, full)

    def longest_hit(self, hashes: List[BlockHash], max_blocks: int) -> int:
        """The largest ``k <= max_blocks`` such that this group can serve a sequence whose
        first ``k`` blocks are those keys: every block for full attention; for a sliding
        window only the blocks the query at position ``k * bs`` sees (scanned right to
        left, as vLLM's sliding-window manager does)."""
        if not self.enable_caching:
            return 0
        max_blocks = min(max_blocks, len(hashes))
        if self.sliding_window is None:
            k = 0
            while k < max_blocks and hashes[k] in self._block_of:
                k += 1
            return k
        k, j = max_blocks, max_blocks - 1
        while k > 0:
            if j < self._first_visible_block(k):
                return k  # blocks first..k-1 are all cached
            if hashes[j] in self._block_of:
                j -= 1
            else:  # every end past j needs block j: try ending right before it
                k, j = j, j - 1
        return 0

    def hit_blocks(self, hashes: List[BlockHash], k: int) -> List[int]:
        """The block list of a hit of ``k`` blocks (``longest_hit`` returned >= k)."""
        first = self._first_visible_block(k) if self.sliding_window is not None else 0
        return [PLACEHOLDER_BLOCK] * first + [self._block_of[h] for h in hashes[first:k]]

    def _first_visible_block(self, k: int) -> int:
        """First block a query at position ``k * bs`` attends to in this sliding group."""
        return max(0, k * self.block_size - self.sliding_window + 1) // self.block_size

    def is_cached(self, block_id: int) -> bool:
        """Whether the block is registered under a content key (used or not)."""
        self._check_id(block_id)
        return self._hash_of[block_id] is not None

    def _take_free(self) -> int:
        if self._free:
            return self._free.popleft()
        b, _ = self._evictable.popitem(last=False)  # least recently used cached block
        self._uncache(b)
        return b

    def _release(self, b: int) -> None:
        """Block b's last user let go: cached if it holds a registered prefix."""
        if self._hash_of[b] is None:
            self._free.append(b)
            return
        self._evictable[b] = None
        if self.max_cached_blocks is not None:
            while len(self._evictable) > self.max_cached_blocks:
                old, _ = self._evictable.popitem(last=False)
                self._uncache(old)
                self._free.append(old)

    def _uncache(self, b: int) -> None:
        del self._block_of[self._hash_of[b]]
        self._hash_of[b] = None

    def _check_id(self, block_id: int) -> None:
        if not isinstance(block_id, numbers.Integral) or not 0 <= block_id < self._num_blocks:
            raise BlockManagerError(f"unknown block id {block_id!r} (cache has {self._num_blocks})")

"""Per-layer cache differences on the scheduler's side: KV cache groups and state slots.

``KVCacheLayout`` (which groups exist, how many blocks each has, how many state slots) is
built by the worker (``ModelRunner``, from the model's ``cache_specs()``) once the cache
is sized; every rank computes the same layout from the same config. Rank 0's engine
builds one ``KVCacheManager`` from it and hands it to the ``Scheduler``, which owns it.

Layers are grouped by kind: group 0 holds the full-attention (and MLA) layers, then one
group per distinct sliding window (ascending); a model whose layers all slide (Mistral)
has that one sliding group as group 0. Every group has its own ``BlockManager`` (its own
pool of block ids into its own layers' tensors) and every sequence its own block list
per group. Linear-attention (``StateSpec``) layers use no blocks: each running sequence
holds one of ``num_state_slots`` (= ``max_num_seqs``) state slots, assigned on
admission and released on finish, abort and preemption (preemption recomputes from
scratch, so the state restarts from zero: the worker zeroes the slot of every sequence
whose step starts at position 0).

Prefix caching (``core/prefix_cache.py``): every group keeps its own key -> block map over
its own pool, and a hit must suit all of them: ``find_cached_prefix`` takes the full
groups' longest run of cached blocks, lowers it until every sliding group holds the
blocks its window needs at that point, and repeats until no group lowers it further.
A model with state layers gets no caching (the engine turns it off): a prefix hit would
need the linear-attention state at the block boundary, which is not kept.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from cvllm.core.block_manager import BlockManager, NoFreeBlocksError
from cvllm.core.prefix_cache import PrefixCacheStats, PrefixHit
from cvllm.core.sequence import Sequence


@dataclass(frozen=True)
class KVCacheGroupConfig:
    sliding_window: Optional[int]
    """Window of every layer in the group; None for full attention and MLA."""
    num_blocks: int
    layer_ids: Tuple[int, ...] = ()
    """Decoder layers whose caches this group's block ids address."""


@dataclass(frozen=True)
class KVCacheLayout:
    block_size: int
    groups: Tuple[KVCacheGroupConfig, ...]
    num_state_slots: int = 0
    """State slots of linear-attention layers (0: the model has none)."""

    def __post_init__(self) -> None:
        if not self.groups:
            raise ValueError("a KV cache layout needs at least one group")
        windows = [g.sliding_window for g in self.groups]
        if len(set(windows)) != len(windows):
            raise ValueError(f"two KV cache groups share a window: {windows}")
        if self.num_state_slots < 0:
            raise ValueError(f"num_state_slots must be >= 0, got {self.num_state_slots}")

    @property
    def windows(self) -> List[Optional[int]]:
        return [g.sliding_window for g in self.groups]

    @classmethod
    def single(cls, num_blocks: int, block_size: int) -> "KVCacheLayout":
        """One full-attention group: what a model of plain attention layers gets."""
        return cls(block_size, (KVCacheGroupConfig(None, num_blocks),))


class KVCacheManager:
    """The block managers of all groups plus the state-slot free list, acting as one."""

    def __init__(self, groups: List[BlockManager], num_state_slots: int = 0) -> None:
        if not groups:
            raise ValueError("KVCacheManager needs at least one group")
        if len({g.block_size for g in groups}) != 1:
            raise ValueError("every KV cache group must have the same block size")
        for i, g in enumerate(groups):
            if g.group != i:
                raise ValueError(f"block manager {i} is for group {g.group}")
        if len({g.enable_caching for g in groups}) != 1:
            raise ValueError("prefix caching must be on in every KV cache group or in none")
        self.groups = groups
        self.num_state_slots = num_state_slots
        self._free_slots: deque[int] = deque(range(num_state_slots))
        self.prefix_cache_stats = PrefixCacheStats()
        self._cached_upto: Dict[int, int] = {}
        """seq_id -> full blocks ``cache_blocks`` has handed to the groups (a fast path:
        most calls, one per scheduled sequence and step, find no new full block)."""

    @classmethod
    def from_layout(cls, layout: KVCacheLayout, enable_caching: bool = False,
                    max_cached_tokens: Optional[int] = None) -> "KVCacheManager":
        """``max_cached_tokens`` caps each group's cached (unused) blocks at that many
        tokens' worth, rounded down to whole blocks."""
        cap = None if max_cached_tokens is None else max_cached_tokens // layout.block_size
        groups = [
            BlockManager(g.num_blocks, layout.block_size, g.sliding_window, group=i,
                         enable_caching=enable_caching, max_cached_blocks=cap)
            for i, g in enumerate(layout.groups)
        ]
        return cls(groups, layout.num_state_slots)

    @property
    def enable_caching(self) -> bool:
        return self.groups[0].enable_caching

    @property
    def block_size(self) -> int:
        return self.groups[0].block_size

    @property
    def windows(self) -> List[Optional[int]]:
        return [g.sliding_window for g in self.groups]

    @property
    def num_free_state_slots(self) -> int:
        return len(self._free_slots)

    # ----- blocks ----------------------------------------------------------------------

    def can_allocate(self, seq: Sequence, num_new_tokens: int,
                     hit: Optional[PrefixHit] = None) -> bool:
        """With ``hit`` (seq holds no blocks yet): whether seq can take the hit's blocks
        and then blocks for ``num_new_tokens`` tokens past them."""
        if hit is None or not hit.num_tokens:
            return all(g.can_allocate(seq, num_new_tokens) for g in self.groups)
        total = hit.num_tokens + num_new_tokens
        return all(g.can_allocate_after_hit(hit.blocks[g.group], total) for g in self.groups)

    def needs_blocks(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether seq needs a fresh block in some group for ``num_new_tokens`` more tokens
        (most decode steps do not: the token lands in the sequence's last block)."""
        return any(g.blocks_needed(seq, num_new_tokens) for g in self.groups)

    def allocate(self, seq: Sequence, num_new_tokens: int,
                 hit: Optional[PrefixHit] = None) -> None:
        """Blocks for ``num_new_tokens`` more tokens in every group (check first); with
        ``hit``, seq first takes the hit's blocks and its ``num_computed_tokens`` must
        already count the hit's tokens."""
        if not self.can_allocate(seq, num_new_tokens, hit):
            # checked up front so that a failure leaves no group half-allocated
            short = [g.group for g in self.groups if not g.can_allocate(seq, num_new_tokens)]
            raise NoFreeBlocksError(f"sequence {seq.seq_id} needs more blocks than are "
                                    f"free in KV group(s) {short or 'of its prefix hit'}")
        for g in self.groups:
            if hit is not None and hit.num_tokens:
                g.share(seq, hit.blocks[g.group])
            g.allocate(seq, num_new_tokens)

    def allocate_copying_hit(self, seq: Sequence, num_new_tokens: int,
                             hit: PrefixHit) -> Optional[List[Tuple[int, int]]]:
        """Like ``allocate(seq, num_new_tokens, hit)``, but seq takes fresh blocks for the
        hit's tokens as well, to be filled by copying the hit's blocks: returns the
        ``(src, dst)`` block pairs, or None, changing nothing, where that does not apply:
        more than one KV group, a sliding window (its hit starts with placeholders) or
        state layers, or fewer plainly free blocks than seq needs (a cached block is never
        evicted for it: it could be one of the hit's). The hit's blocks stay as they were
        (cached, or shared by whoever holds them)."""
        if (len(self.groups) != 1 or self.groups[0].sliding_window is not None
                or self.num_state_slots or not hit.num_tokens):
            return None
        g, src = self.groups[0], list(hit.blocks[0])
        if seq.group_block_ids(0) or seq.num_computed_tokens != hit.num_tokens:
            raise ValueError(f"{seq!r} must hold no blocks and count the hit's tokens as computed")
        if g.blocks_needed(seq, num_new_tokens) > g.num_plain_free_blocks:
            return None
        new = g.allocate(seq, num_new_tokens)  # seq holds none yet: the hit's too
        return list(zip(src, new[:len(src)]))

    # ----- prefix cache ------------------------------------------------------------------

    def find_cached_prefix(self, seq: Sequence) -> PrefixHit:
        """The longest block-aligned prefix of seq's tokens every group holds, leaving
        at least its last token to compute (its logits are needed). Changes nothing."""
        if not self.enable_caching:
            return PrefixHit(0, [[] for _ in self.groups])
        hashes = seq.update_block_hashes(self.block_size)
        k = min(len(hashes), (seq.num_tokens - 1) // self.block_size)
        while True:  # a sliding group may lower k; then every group looks again
            lowest = k
            for g in self.groups:
                lowest = g.longest_hit(hashes, lowest)
            if lowest == k:
                break
            k = lowest
        return PrefixHit(k * self.block_size, [g.hit_blocks(hashes, k) for g in self.groups])

    def cache_blocks(self, seq: Sequence) -> None:
        """Register seq's full blocks whose tokens are confirmed and counted as computed
        (``schedule()`` counts a step's tokens once the step is scheduled: the step runs
        before any step that could read the blocks through a hit)."""
        if not self.enable_caching:
            return
        num_tokens = min(seq.num_computed_tokens, seq.num_confirmed_tokens)
        full = num_tokens // self.block_size
        if full <= self._cached_upto.get(seq.seq_id, 0):
            return
        seq.update_block_hashes(self.block_size)
        for g in self.groups:
            g.cache_blocks(seq, num_tokens)
        self._cached_upto[seq.seq_id] = full

    def record_lookup(self, seq: Sequence, hit: PrefixHit) -> None:
        """Count an admitted sequence's lookup (first admission only) and note its
        cached prompt tokens on it."""
        if not self.enable_caching or seq.num_preemptions:
            return
        seq.num_cached_tokens = min(hit.num_tokens, seq.num_prompt_tokens)
        self.prefix_cache_stats.queries += seq.num_tokens
        self.prefix_cache_stats.hits += hit.num_tokens

    @property
    def num_cached_free_blocks(self) -> int:
        """Unused blocks holding cached prefixes, over every group (counted as free)."""
        return sum(g.num_cached_free_blocks for g in self.groups)

    def can_ever_fit(self, seq: Sequence, max_chunk: int) -> bool:
        """Whether seq's known tokens fit every group's whole pool, taken ``max_chunk``
        new tokens a step."""
        return all(
            g.max_blocks_per_seq(seq.num_tokens, max_chunk) <= g.num_total_blocks
            for g in self.groups
        )

    def remove_out_of_window_blocks(self, seq: Sequence) -> int:
        """After a step: free blocks of sliding groups no future query sees; returns how
        many were freed."""
        return sum(len(g.remove_out_of_window_blocks(seq)) for g in self.groups)

    def free(self, seq: Sequence) -> None:
        """Release everything seq holds: blocks in every group and its state slot."""
        for g in self.groups:
            g.free(seq)
        self._cached_upto.pop(seq.seq_id, None)
        self.free_state_slot(seq)

    # ----- state slots -------------------------------------------------------------------

    def can_assign_state_slot(self, seq: Sequence) -> bool:
        return self.num_state_slots == 0 or seq.state_slot >= 0 or bool(self._free_slots)

    def assign_state_slot(self, seq: Sequence) -> None:
        """Give seq a state slot (no-op without state layers or when it has one)."""
        if self.num_state_slots == 0 or seq.state_slot >= 0:
            return
        if not self._free_slots:
            raise RuntimeError(f"no free state slot for {seq!r}")
        seq.state_slot = self._free_slots.popleft()

    def free_state_slot(self, seq: Sequence) -> None:
        if seq.state_slot < 0:
            return
        if not 0 <= seq.state_slot < self.num_state_slots or seq.state_slot in self._free_slots:
            raise RuntimeError(f"bad state slot release {seq.state_slot} of {seq!r}")
        self._free_slots.append(seq.state_slot)
        seq.state_slot = -1

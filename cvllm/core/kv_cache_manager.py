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
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import List, Optional, Tuple

from cvllm.core.block_manager import BlockManager, NoFreeBlocksError
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
        self.groups = groups
        self.num_state_slots = num_state_slots
        self._free_slots: deque[int] = deque(range(num_state_slots))

    @classmethod
    def from_layout(cls, layout: KVCacheLayout) -> "KVCacheManager":
        groups = [
            BlockManager(g.num_blocks, layout.block_size, g.sliding_window, group=i)
            for i, g in enumerate(layout.groups)
        ]
        return cls(groups, layout.num_state_slots)

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

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return all(g.can_allocate(seq, num_new_tokens) for g in self.groups)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Blocks for ``num_new_tokens`` more tokens in every group (check first)."""
        short = [g.group for g in self.groups if not g.can_allocate(seq, num_new_tokens)]
        if short:  # checked up front so that a failure leaves no group half-allocated
            raise NoFreeBlocksError(
                f"sequence {seq.seq_id} needs more blocks than are free in KV group(s) {short}"
            )
        for g in self.groups:
            g.allocate(seq, num_new_tokens)

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

"""Process groups of this rank (minimal: a single process, tp_rank 0 of tp_size 1).

Owned by this module, one per process; read by the parallel layers at construction (to
size and slice their shards) and by ``distributed/comm.py`` (to pick the group of a
collective). The multi-process set-up (``initialize_model_parallel`` over NCCL / gloo) is
filled in by the distributed issue; until then every value here is the honest
single-process one and nothing pretends to be a real group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class GroupCoordinator:
    """One process group as seen from this rank (vLLM's name)."""

    rank_in_group: int
    """This rank's index inside the group (``tp_rank`` for the TP group)."""
    world_size: int
    """Number of ranks in the group (``tp_size``)."""
    device_group: Optional[Any] = None
    """The ``torch.distributed`` group for device collectives; None in a single process."""

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank_in_group < self.world_size:
            raise ValueError(f"bad group: rank {self.rank_in_group} of {self.world_size}")


_TP: GroupCoordinator = GroupCoordinator(rank_in_group=0, world_size=1)


def get_tp_group() -> GroupCoordinator:
    """The tensor-parallel group of this process (single-process until initialised)."""
    return _TP


def get_tensor_model_parallel_rank() -> int:
    return _TP.rank_in_group


def get_tensor_model_parallel_world_size() -> int:
    return _TP.world_size

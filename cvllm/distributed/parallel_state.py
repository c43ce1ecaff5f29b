"""Process groups of this rank: its tensor-parallel rank, size and collective groups.

Owned by this module; set once per rank by the launcher (``initialize_model_parallel``)
before the model is built, read by the parallel layers at construction (to size and
slice their shards) and by ``distributed/comm.py`` (to pick the group of a collective).
Until it is called every value is the honest single-process one (rank 0 of 1).

Under ``--multithread`` every rank is a thread of one process, so the group is kept
per thread (``thread_local=True``); otherwise one process-wide group.
"""

from __future__ import annotations

import threading
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
    """The group for device collectives (a ``torch.distributed`` ProcessGroup: NCCL on
    GPUs, gloo on the CPU; or an in-process group under --multithread); None in a single
    process."""
    cpu_group: Optional[Any] = None
    """A gloo group over the same ranks for host-side agreement (KV cache size); defaults
    to ``device_group`` when that already runs on the CPU."""

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank_in_group < self.world_size:
            raise ValueError(f"bad group: rank {self.rank_in_group} of {self.world_size}")


_SINGLE = GroupCoordinator(rank_in_group=0, world_size=1)
_TP: GroupCoordinator = _SINGLE
_THREAD = threading.local()


def initialize_model_parallel(tp_rank: int, tp_size: int, device_group: Any = None,
                              cpu_group: Any = None, thread_local: bool = False) -> GroupCoordinator:
    """Make this rank (this thread, with ``thread_local``) rank ``tp_rank`` of ``tp_size``.
    Call before building the model: layers read the group at construction."""
    global _TP
    group = GroupCoordinator(tp_rank, tp_size, device_group, cpu_group or device_group)
    if thread_local:
        _THREAD.tp = group
    else:
        _TP = group
    return group


def destroy_model_parallel() -> None:
    """Back to the single-process group (this thread's and the process-wide one)."""
    global _TP
    _TP = _SINGLE
    _THREAD.__dict__.pop("tp", None)


def get_tp_group() -> GroupCoordinator:
    """The tensor-parallel group of this thread or process (single until initialised)."""
    return getattr(_THREAD, "tp", None) or _TP


def get_tensor_model_parallel_rank() -> int:
    return get_tp_group().rank_in_group


def get_tensor_model_parallel_world_size() -> int:
    return get_tp_group().world_size

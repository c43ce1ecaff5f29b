"""Collectives between the threads of one process (``--multithread``, candle-vllm's
debugging mode).

Built once by the composition root (``cli.py``) on the main thread as
``InProcessGroup(world_size)``; every rank thread then takes its own
``group.rank_view(rank)`` and passes it to ``initialize_model_parallel(...,
thread_local=True)`` as both device and cpu group, so ``distributed/comm.py`` can run the
same collectives it runs over ``torch.distributed``. The group also owns the queues of the
in-process control plane (``control_plane.InProcessControlPlane``).

Every collective is two barrier phases: each rank posts its tensor, all wait, each rank
reads every post and computes the result itself, all wait again (so no rank overwrites
its input while another still reads it), then results are written back. Sums run in rank
order (rank 0 + rank 1 + ...), so every thread gets bit-identical results whatever the
thread timing. A rank that fails calls ``abort()``: every thread waiting in a collective
then raises ``InProcessAbort`` instead of hanging.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable, List, Optional

import torch

DEFAULT_TIMEOUT_S = 600.0


class InProcessAbort(RuntimeError):
    """The group was aborted (a rank failed) or a collective timed out."""


class InProcessGroup:
    """The group shared by the rank threads of ``--multithread``."""

    def __init__(self, world_size: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.timeout_s = timeout_s
        self._barrier = threading.Barrier(world_size, timeout=timeout_s)
        self._posts: List[Any] = [None] * world_size
        self.control_queues: List["queue.Queue[bytes]"] = [queue.Queue() for _ in range(world_size)]
        """Rank 0 -> rank r control-plane messages (framed bytes), one queue per rank."""
        self.aborted = False

    def rank_view(self, rank: int) -> "InProcessRankGroup":
        """This group as seen from ``rank`` (what comm.py and parallel_state hold)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside a group of {self.world_size}")
        return InProcessRankGroup(self, rank)

    def abort(self) -> None:
        """Wake every rank waiting in a collective with ``InProcessAbort``."""
        self.aborted = True
        self._barrier.abort()

    def _wait(self) -> None:
        try:
            self._barrier.wait()
        except threading.BrokenBarrierError:
            self.aborted = True
            raise InProcessAbort(
                "in-process group aborted (a rank failed or a collective timed out after "
                f"{self.timeout_s:.0f} s)"
            ) from None

    def exchange(self, rank: int, value: Any, combine: Callable[[List[Any]], Any]) -> Any:
        """Post ``value``, then return ``combine(all posts in rank order)`` computed on this
        thread. The posts stay valid until every rank has combined."""
        self._posts[rank] = value
        self._wait()  # every rank has posted
        try:
            result = combine(list(self._posts))
        finally:
            self._wait()  # every rank has read the posts
        return result


class InProcessRankGroup:
    """One rank's handle on an ``InProcessGroup``: the collectives comm.py calls."""

    def __init__(self, group: InProcessGroup, rank: int) -> None:
        self.group, self.rank, self.world_size = group, rank, group.world_size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum in place, in rank order."""
        def total(posts: List[torch.Tensor]) -> torch.Tensor:
            out = posts[0].clone()
            for t in posts[1:]:
                out += t
            return out

        x.copy_(self.group.exchange(self.rank, x, total))
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's ``x`` along ``dim`` in rank order (a new tensor)."""
        return self.group.exchange(self.rank, x, lambda posts: torch.cat(posts, dim=dim))

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Copy rank ``src``'s ``x`` into every rank's ``x`` (in place)."""
        if not 0 <= src < self.world_size:
            raise ValueError(f"broadcast source {src} outside a group of {self.world_size}")
        got = self.group.exchange(self.rank, x, lambda posts: posts[src].clone())
        if self.rank != src:
            x.copy_(got)
        return x

    def reduce_int(self, value: int, op: Callable[[List[int]], int]) -> int:
        """``op`` (e.g. ``min``) over every rank's integer."""
        return int(self.group.exchange(self.rank, int(value), op))

    def barrier(self) -> None:
        self.group.exchange(self.rank, None, lambda posts: None)

    def abort(self) -> None:
        self.group.abort()

    def __repr__(self) -> str:
        return f"InProcessRankGroup(rank={self.rank}, world_size={self.world_size})"


def run_ranks(world_size: int, fn: Callable[[int, InProcessGroup], Any],
              timeout_s: Optional[float] = None) -> List[Any]:
    """Run ``fn(rank, group)`` on ``world_size`` threads and return the results in rank
    order; the first exception (any rank) aborts the group and is re-raised here."""
    group = InProcessGroup(world_size, **({"timeout_s": timeout_s} if timeout_s else {}))
    results: List[Any] = [None] * world_size
    errors: List[Optional[BaseException]] = [None] * world_size

    def body(rank: int) -> None:
        try:
            results[rank] = fn(rank, group)
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
            errors[rank] = e
            group.abort()

    threads = [threading.Thread(target=body, args=(r,), name=f"cvllm-rank{r}", daemon=True)
               for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    first = next((e for e in errors if e is not None and not isinstance(e, InProcessAbort)),
                 next((e for e in errors if e is not None), None))
    if first is not None:
        raise first
    return results

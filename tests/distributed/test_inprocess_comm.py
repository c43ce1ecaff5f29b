"""comm.py collectives over the in-process group of --multithread, and the tp=1 identity."""

import threading

import pytest
import torch

from cvllm.distributed import comm, parallel_state
from cvllm.distributed.inprocess import InProcessAbort, InProcessGroup, run_ranks


def _with_tp(fn):
    """Run ``fn(rank)`` on each rank thread with the thread's TP group initialised."""
    def body(rank, group):
        view = group.rank_view(rank)
        parallel_state.initialize_model_parallel(rank, group.world_size, view, view,
                                                 thread_local=True)
        try:
            return fn(rank)
        finally:
            parallel_state.destroy_model_parallel()
    return body


def _rank_tensor(rank, n=7):
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(n, generator=g) * 10 ** (rank * 3)  # magnitudes make order matter


def test_tp1_collectives_are_identity():
    x = torch.arange(6.0).reshape(2, 3)
    assert comm.tensor_model_parallel_all_reduce(x) is x
    assert comm.tensor_model_parallel_all_gather(x, dim=0) is x
    assert comm.tensor_model_parallel_broadcast(x) is x
    assert comm.agree_min(5) == 5 and comm.agree_max(7) == 7
    comm.barrier()


@pytest.mark.parametrize("world", [2, 3])
def test_all_reduce_sums_in_rank_order(world):
    expected = _rank_tensor(0)
    for r in range(1, world):
        expected = expected + _rank_tensor(r)

    def fn(rank):
        x = _rank_tensor(rank)
        out = comm.tensor_model_parallel_all_reduce(x)
        assert out is x  # in place
        return x

    for got in run_ranks(world, _with_tp(fn), timeout_s=30):
        assert torch.equal(got, expected)  # bit-identical on every rank


def test_all_gather_and_broadcast():
    def fn(rank):
        x = torch.full((2, 3), float(rank)) + torch.arange(3.0)  # [2, 3]
        last = comm.tensor_model_parallel_all_gather(x, dim=-1)
        first = comm.tensor_model_parallel_all_gather(x, dim=0)
        b = torch.full((4,), float(rank + 1))
        comm.tensor_model_parallel_broadcast(b, src=1)
        return last, first, b

    results = run_ranks(3, _with_tp(fn), timeout_s=30)
    parts = [torch.full((2, 3), float(r)) + torch.arange(3.0) for r in range(3)]
    for last, first, b in results:
        assert torch.equal(last, torch.cat(parts, dim=1))
        assert torch.equal(first, torch.cat(parts, dim=0))
        assert torch.equal(b, torch.full((4,), 2.0))


def test_agree_min_max_and_barrier():
    order = []
    lock = threading.Lock()

    def fn(rank):
        with lock:
            order.append(("before", rank))
        comm.barrier()
        with lock:
            order.append(("after", rank))
        return comm.agree_min(100 - rank * 7), comm.agree_max(rank * 3)

    assert run_ranks(3, _with_tp(fn), timeout_s=30) == [(86, 6)] * 3
    assert [k for k, _ in order[:3]] == ["before"] * 3  # nobody passed the barrier early


def test_failing_rank_aborts_the_others():
    def fn(rank):
        if rank == 1:
            raise RuntimeError("rank 1 exploded")
        comm.tensor_model_parallel_all_reduce(torch.ones(2))  # would wait forever

    with pytest.raises(RuntimeError, match="rank 1 exploded"):
        run_ranks(2, _with_tp(fn), timeout_s=30)


def test_collective_timeout_raises():
    group = InProcessGroup(2, timeout_s=0.2)
    with pytest.raises(InProcessAbort, match="aborted"):
        group.rank_view(0).barrier()  # rank 1 never comes
    assert group.aborted


def test_group_accepted_without_rank_view():
    """comm.py also accepts the InProcessGroup itself (rank from the coordinator)."""
    def body(rank, group):
        parallel_state.initialize_model_parallel(rank, 2, group, group, thread_local=True)
        try:
            return comm.tensor_model_parallel_all_reduce(torch.tensor([rank + 1.0]))
        finally:
            parallel_state.destroy_model_parallel()

    assert [t.item() for t in run_ranks(2, body, timeout_s=30)] == [3.0, 3.0]


def test_bad_rank_view():
    with pytest.raises(ValueError):
        InProcessGroup(2).rank_view(2)
    with pytest.raises(ValueError):
        InProcessGroup(0)

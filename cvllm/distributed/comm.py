"""Collectives of the model forward: the only place that calls them (DESIGN rule 6).

Called by the parallel layers (RowParallelLinear, VocabParallelEmbedding, the LM head)
on every rank in lockstep, and by the runner for host-side agreement (KV cache size);
the group comes from ``parallel_state.get_tp_group()``. With one TP rank every collective
is the identity and touches no ``torch.distributed`` state. The group is either a
``torch.distributed`` ProcessGroup (NCCL on GPUs, gloo on the CPU) or, under
``--multithread``, an ``inprocess.InProcessRankGroup`` (an ``InProcessGroup`` is accepted
too: the rank then comes from the coordinator). Small all-reduces between the NVLink
peers of one node go through ``custom_allreduce`` when it was enabled at start-up, which
can also fuse the residual add + RMSNorm that follows (``all_reduce_rms_norm``).
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch

from cvllm.distributed import custom_allreduce, parallel_state
from cvllm.distributed.inprocess import InProcessGroup, InProcessRankGroup


def _inprocess(group: Any, rank: int) -> InProcessRankGroup | None:
    if isinstance(group, InProcessRankGroup):
        return group
    if isinstance(group, InProcessGroup):
        return group.rank_view(rank)
    return None


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the TP group; use the returned tensor (in place through NCCL or
    gloo, a new tensor through ``custom_allreduce`` for small GPU tensors)."""
    group = parallel_state.get_tp_group()
    if group.world_size == 1:
        return x
    local = _inprocess(group.device_group, group.rank_in_group)
    if local is not None:
        return local.all_reduce(x)
    fast = custom_allreduce.active()
    if fast is not None and fast.accepts(x):
        return fast.all_reduce(x)  # small tensors between NVLink peers: a new tensor
    import torch.distributed as dist

    dist.all_reduce(x, group=group.device_group)
    return x


def all_reduce_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                        eps: float) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """``(rms_norm(sum(x) + residual) * weight, sum(x) + residual)`` in one kernel when
    the custom all-reduce takes these tensors (``residual`` is updated in place), else
    None: the caller then all-reduces and normalises itself. The roundings are those of
    ``tensor_model_parallel_all_reduce`` followed by ``layers.layernorm.RMSNorm``."""
    fast = custom_path()
    if fast is None or not fast.accepts_norm(x, residual, weight):
        return None
    return fast.all_reduce_rms_norm(x, residual, weight, eps)


def custom_path() -> Optional["custom_allreduce.CustomAllReduce"]:
    """The custom all-reduce where it serves this TP group, else None (one rank,
    in-process ranks, NCCL only); also where a row-parallel GEMV pushes its partial sums
    for the next reduction (``CustomAllReduce.push_target``)."""
    group = parallel_state.get_tp_group()
    if group.world_size == 1 or _inprocess(group.device_group, group.rank_in_group) is not None:
        return None
    return custom_allreduce.active()


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` in rank order."""
    group = parallel_state.get_tp_group()
    if group.world_size == 1:
        return x
    dim = dim % x.dim()
    local = _inprocess(group.device_group, group.rank_in_group)
    if local is not None:
        return local.all_gather(x, dim)
    import torch.distributed as dist

    # Gloo wants the output concatenated along dim 0 ([tp * x0, ...]); NCCL takes it too.
    flat = torch.empty(
        (group.world_size * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device
    )  # [tp * x0, *x[1:]]
    # all_gather_single is the newer name; all_gather_into_tensor warns there.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(flat, x.contiguous(), group=group.device_group)
    out = flat.view((group.world_size,) + tuple(x.shape)).movedim(0, dim)  # [..., tp, x[dim], ...]
    return out.reshape(x.shape[:dim] + (-1,) + x.shape[dim + 1 :])


def tensor_model_parallel_broadcast(x: torch.Tensor, src: int = 0) -> torch.Tensor:
    """Copy TP rank ``src``'s ``x`` into every rank's ``x`` (in place, device group)."""
    group = parallel_state.get_tp_group()
    if group.world_size == 1:
        return x
    local = _inprocess(group.device_group, group.rank_in_group)
    if local is not None:
        return local.broadcast(x, src)
    import torch.distributed as dist

    dist.broadcast(x, src=dist.get_global_rank(group.device_group, src),
                   group=group.device_group)
    return x


def _reduce_int(value: int, op_name: str) -> int:
    group = parallel_state.get_tp_group()
    if group.world_size == 1:
        return int(value)
    cpu_group = group.cpu_group if group.cpu_group is not None else group.device_group
    local = _inprocess(cpu_group, group.rank_in_group)
    if local is not None:
        return local.reduce_int(value, min if op_name == "min" else max)
    import torch.distributed as dist

    # A cpu_group is gloo; if only an NCCL group exists the value travels on the GPU.
    on_gpu = dist.get_backend(cpu_group) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else "cpu"
    t = torch.tensor([int(value)], dtype=torch.int64, device=device)  # [1]
    op = dist.ReduceOp.MIN if op_name == "min" else dist.ReduceOp.MAX
    dist.all_reduce(t, op=op, group=cpu_group)
    return int(t.item())


def agree_min(value: int) -> int:
    """The minimum of ``value`` over every TP rank (host side; e.g. KV cache blocks)."""
    return _reduce_int(value, "min")


def agree_max(value: int) -> int:
    """The maximum of ``value`` over every TP rank (host side)."""
    return _reduce_int(value, "max")


def barrier() -> None:
    """Wait until every TP rank gets here (cpu group)."""
    group = parallel_state.get_tp_group()
    if group.world_size == 1:
        return
    cpu_group = group.cpu_group if group.cpu_group is not None else group.device_group
    local = _inprocess(cpu_group, group.rank_in_group)
    if local is not None:
        local.barrier()
        return
    import torch.distributed as dist

    dist.barrier(group=cpu_group)

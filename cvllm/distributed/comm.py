"""Collectives of the model forward: the only place that calls them (DESIGN rule 6).

Called by the parallel layers (RowParallelLinear, VocabParallelEmbedding, the LM head)
on every rank in lockstep; the group comes from ``parallel_state.get_tp_group()``. With
one TP rank every collective is the identity and touches no ``torch.distributed`` state.
"""

from __future__ import annotations

import torch

from cvllm.distributed import parallel_state


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the TP group (in place when the group has several ranks)."""
    group = parallel_state.get_tp_group()
    if group.world_size == 1:
        return x
    import torch.distributed as dist

    dist.all_reduce(x, group=group.device_group)
    return x


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` in rank order."""
    group = parallel_state.get_tp_group()
    if group.world_size == 1:
        return x
    import torch.distributed as dist

    dim = dim % x.dim()
    out = torch.empty(
        (group.world_size,) + tuple(x.shape), dtype=x.dtype, device=x.device
    )  # [tp, *x]
    dist.all_gather_into_tensor(out, x.contiguous(), group=group.device_group)
    out = out.movedim(0, dim)  # [..., tp, x.shape[dim], ...]
    return out.reshape(x.shape[:dim] + (-1,) + x.shape[dim + 1 :])

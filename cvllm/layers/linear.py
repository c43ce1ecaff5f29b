"""Parallel linear layers: each owns its TP sharding and delegates the math.

Built by the model classes at construction. A layer reads ``tp_rank`` / ``tp_size``
from ``distributed.parallel_state`` once, asks the ``QuantizationConfig`` (or defaults to
``UnquantizedLinearMethod``) to create this rank's parameters, and gives each parameter a
``weight_loader(param, loaded_weight, shard_id=None)`` that cuts this rank's slice out of
the full checkpoint tensor. Models never slice weights; ``RowParallelLinear`` alone calls
a collective (through ``distributed/comm.py``).

Sharding (vLLM's): Column* split the output features, Row splits the input features;
QKV splits the query heads evenly when tp_size divides them (3 and 6 as well as powers of
two) and otherwise in balanced uneven ranges padded to one slot count (``q_head_assignment``;
the output projection then takes ``input_blocks``), and gives each rank the KV heads its
query heads use (``kv_head_assignment``): a contiguous share when tp_size divides the KV heads, one
replicated head per rank when the KV heads divide tp_size, and otherwise (tp 3 over
6 query / 2 KV heads) as many as make this rank's grouping uniform, some of them copies.

Checkpoint tensors may be lazy (``layers/utils.py``): every loader here narrows before
it copies, so a rank reads only its slice.
"""

from __future__ import annotations

from typing import List, Optional, Tuple, Union

import torch
from torch import nn

from cvllm.distributed import parallel_state
from cvllm.distributed.comm import (
    custom_path,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from cvllm.layers.utils import (
    balanced_range, consecutive_runs, copy_checked, divide, split_sizes,
)
from cvllm.quantization.base import LinearMethodBase, QuantizationConfig, frozen_param
from cvllm.quantization.packed import check_input_split, weight_view
from cvllm.quantization.unquantized import UnquantizedLinearMethod


def shard_of(loaded, dim: int, tp_rank: int, tp_size: int):
    """Rank ``tp_rank``'s equal share of ``loaded`` along ``dim`` (a narrow: lazy tensors
    stay lazy)."""
    return loaded.narrow(dim, tp_rank * divide(loaded.shape[dim], tp_size),
                         divide(loaded.shape[dim], tp_size))


class LinearBase(nn.Module):
    def __init__(
        self,
        input_size: int,
        output_size: int,
        params_dtype: Optional[torch.dtype] = None,
        quant_config: Optional[QuantizationConfig] = None,
        prefix: str = "",
    ):
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.params_dtype = params_dtype or torch.get_default_dtype()
        self.prefix = prefix
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.tp_size = parallel_state.get_tensor_model_parallel_world_size()
        method = None
        if quant_config is not None and self.quantizable:
            method = quant_config.get_quant_method(self, prefix)
        self.quant_method: LinearMethodBase = method or UnquantizedLinearMethod()

    quantizable = True
    """False for a layer whose loader rearranges its weight beyond the parallel layers'
    row / column slices (MLA's kv_b): it stays unquantized (a GGUF tensor is dequantized)."""

    def _check_granularity(self, in_per_partition: int, piece: Optional[int] = None) -> None:
        check_input_split(self.prefix, self.input_size, self.tp_size, in_per_partition,
                          self.quant_method.input_granularity(), piece)

    def _create(
        self, in_per_partition: int, out_partition_sizes: List[int], bias: bool, bias_size: int
    ) -> None:
        self._check_granularity(in_per_partition)
        self.quant_method.create_weights(
            self,
            in_per_partition,
            out_partition_sizes,
            self.input_size,
            self.output_size,
            self.params_dtype,
            weight_loader=self.weight_loader,
        )
        if bias:
            self.bias = frozen_param(torch.empty(bias_size, dtype=self.params_dtype),  # [out]
                                     output_dim=0, weight_loader=self.weight_loader)
        else:
            self.register_parameter("bias", None)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None
    ) -> None:
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_size}, tp={self.tp_rank}/{self.tp_size}"


class ReplicatedLinear(LinearBase):
    """The full weight on every rank."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        params_dtype: Optional[torch.dtype] = None,
        quant_config: Optional[QuantizationConfig] = None,
        prefix: str = "",
    ):
        super().__init__(input_size, output_size, params_dtype, quant_config, prefix)
        self._create(input_size, [output_size], bias, output_size)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None
    ) -> None:
        copy_checked(weight_view(param), loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)


class ColumnParallelLinear(LinearBase):
    """Output features split over ranks: ``Y_rank = X @ A_rank``."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        gather_output: bool = False,
        params_dtype: Optional[torch.dtype] = None,
        quant_config: Optional[QuantizationConfig] = None,
        prefix: str = "",
        output_sizes: Optional[List[int]] = None,
    ):
        super().__init__(input_size, output_size, params_dtype, quant_config, prefix)
        self.gather_output = gather_output
        self.output_sizes = list(output_sizes) if output_sizes else [output_size]
        self.output_size_per_partition = divide(output_size, self.tp_size)
        partition_sizes = [divide(s, self.tp_size) for s in self.output_sizes]
        self._create(input_size, partition_sizes, bias, self.output_size_per_partition)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None
    ) -> None:
        output_dim = getattr(param, "output_dim", None)
        if output_dim is not None:
            loaded_weight = shard_of(loaded_weight, output_dim, self.tp_rank, self.tp_size)
        copy_checked(weight_view(param), loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.quant_method.apply(self, x, self.bias)  # [.., out / tp]
        return tensor_model_parallel_all_gather(y) if self.gather_output else y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs fused into one matmul (gate_up_proj); checkpoint
    tensors arrive one per ``shard_id`` (index into ``output_sizes``)."""

    def __init__(
        self,
        input_size: int,
        output_sizes: List[int],
        bias: bool = True,
        gather_output: bool = False,
        params_dtype: Optional[torch.dtype] = None,
        quant_config: Optional[QuantizationConfig] = None,
        prefix: str = "",
    ):
        super().__init__(
            input_size,
            sum(output_sizes),
            bias,
            gather_output,
            params_dtype,
            quant_config,
            prefix,
            output_sizes=output_sizes,
        )

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Optional[int] = None
    ) -> None:
        output_dim = getattr(param, "output_dim", None)
        if output_dim is None:
            copy_checked(weight_view(param), loaded_weight)
            return
        if shard_id is None:  # a pre-fused checkpoint tensor: split it and load each part
            for i, part in enumerate(split_sizes(loaded_weight, self.output_sizes, output_dim)):
                self.weight_loader(param, part, i)
            return
        size = divide(self.output_sizes[shard_id], self.tp_size)
        offset = divide(sum(self.output_sizes[:shard_id]), self.tp_size)
        if loaded_weight.shape[output_dim] != self.output_sizes[shard_id]:
            raise ValueError(f"shape mismatch: shard {shard_id} tensor "
                             f"{tuple(loaded_weight.shape)} has not {self.output_sizes[shard_id]} "
                             f"rows in dim {output_dim}")
        dst = weight_view(param).narrow(output_dim, offset, size)
        copy_checked(dst, loaded_weight.narrow(output_dim, self.tp_rank * size, size))


def q_head_assignment(num_heads: int, tp_size: int, tp_rank: int) -> Tuple[List[int], int]:
    """``(global query head of each local slot, real head count)`` of rank ``tp_rank``.

    tp | H: heads ``[r * H/tp, (r + 1) * H/tp)``, no padding. Otherwise the balanced uneven
    split ``[r * H // tp, (r + 1) * H // tp)`` (9 over 2: 4 and 5 heads), padded to
    ``ceil(H / tp)`` slots on every rank by repeating the rank's last head, so attention and
    the KV cache have one shape on all ranks; ``RowParallelLinear`` gives padding slots
    zero columns, so they add nothing."""
    if not 0 < tp_size <= num_heads:
        raise ValueError(f"{num_heads} attention heads cannot be split over {tp_size} ranks "
                         "(every rank needs at least one head)")
    start, count = balanced_range(num_heads, tp_size, tp_rank)
    slots = -(-num_heads // tp_size)
    ids = list(range(start, start + count))
    return ids + [ids[-1]] * (slots - count), count


def kv_head_assignment(num_heads: int, num_kv_heads: int, tp_size: int,
                       tp_rank: int) -> List[int]:
    """The global KV heads rank ``tp_rank`` holds, in its local order.

    Query head ``h`` uses KV head ``h // (num_heads / num_kv_heads)``; rank ``r`` holds the
    query heads of ``q_head_assignment`` (``H_loc`` slots, the same on every rank).
    Attention groups a rank's query heads uniformly (local query head ``i`` uses local KV
    head ``i // (H_loc / K_loc)``), so ``K_loc`` is the smallest divisor of ``H_loc`` for
    which, on every rank, each run of ``H_loc / K_loc`` query slots uses one KV head; the
    same on all ranks, so every rank has the same cache shape. tp | Hkv: ``Hkv / tp`` heads
    ``[r * Hkv/tp, ...)``; Hkv | tp: one head, ``r * Hkv // tp``; otherwise some heads
    twice (tp 3, H 6, Hkv 2: [0, 0], [0, 1], [1, 1]; tp 2, H 9, Hkv 3: [0, 0, 0, 1, 1],
    [1, 1, 2, 2, 2])."""
    group = divide(num_heads, num_kv_heads)
    ranks = [q_head_assignment(num_heads, tp_size, r)[0] for r in range(tp_size)]
    slots = len(ranks[0])
    for k_loc in range(1, slots + 1):
        if slots % k_loc:
            continue
        run = slots // k_loc
        if all(ids[j * run] // group == ids[(j + 1) * run - 1] // group
               for ids in ranks for j in range(k_loc)):
            return [ranks[tp_rank][j * run] // group for j in range(k_loc)]
    raise AssertionError("unreachable: one KV head per query slot always fits")


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection, split by heads; ``shard_id`` is ``'q'``, ``'k'`` or ``'v'``.

    ``q_rows_per_head``: checkpoint q rows per query head in units of ``head_size`` (2 for
    Qwen3-Next, whose q projection carries each head's output gate after its query), so
    a rank keeps each head with its gate. ``num_heads`` / ``num_kv_heads`` are this rank's
    (models read them here); ``q_head_ids`` / ``kv_head_ids`` the global heads it holds.
    When tp does not divide the heads, ``num_heads`` counts padding slots too and the
    model passes ``o_proj_input_blocks`` to its ``RowParallelLinear`` output projection."""

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: Optional[int] = None,
        bias: bool = True,
        params_dtype: Optional[torch.dtype] = None,
        quant_config: Optional[QuantizationConfig] = None,
        prefix: str = "",
        q_rows_per_head: int = 1,
    ):
        tp_size = parallel_state.get_tensor_model_parallel_world_size()
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.head_size = head_size
        self.q_rows_per_head = q_rows_per_head
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads or total_num_heads
        self.q_head_ids, self.num_real_heads = q_head_assignment(total_num_heads, tp_size,
                                                                 tp_rank)
        self.num_heads = len(self.q_head_ids)
        self.kv_head_ids = kv_head_assignment(
            total_num_heads, self.total_num_kv_heads, tp_size, tp_rank)
        self.num_kv_heads = len(self.kv_head_ids)
        q_out = self.num_heads * q_rows_per_head * head_size * tp_size
        kv_out = self.num_kv_heads * head_size * tp_size
        super().__init__(
            hidden_size,
            q_out + 2 * kv_out,
            bias,
            False,
            params_dtype,
            quant_config,
            prefix,
            output_sizes=[q_out, kv_out, kv_out],
        )

    @property
    def o_proj_input_blocks(self) -> Optional[List[Optional[int]]]:
        """The global query head behind each of this rank's attention output blocks
        (``None``: a padding slot), for ``RowParallelLinear(input_blocks=...)``; ``None``
        when tp divides the heads (the plain even split)."""
        if self.num_real_heads * self.tp_size == self.total_num_heads:
            return None
        pad = self.num_heads - self.num_real_heads
        return self.q_head_ids[:self.num_real_heads] + [None] * pad

    def _copy_heads(self, dst: torch.Tensor, src, dim: int, base: int, ids: List[int],
                    rows: int) -> None:
        """Copy global heads ``ids`` (``rows`` rows each) of ``src`` into ``dst`` from
        ``base`` on: one narrow per run of consecutive heads (one in the usual cases)."""
        for local, head, count in consecutive_runs(ids):
            copy_checked(dst.narrow(dim, base + local * rows, count * rows),
                         src.narrow(dim, head * rows, count * rows))

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Union[str, None] = None
    ) -> None:
        output_dim = getattr(param, "output_dim", None)
        if output_dim is None:
            copy_checked(weight_view(param), loaded_weight)
            return
        D = self.head_size
        if shard_id is None:  # a pre-fused checkpoint qkv tensor
            sizes = [self.total_num_heads * self.q_rows_per_head * D] + [
                self.total_num_kv_heads * D] * 2
            for sid, part in zip("qkv", split_sizes(loaded_weight, sizes, output_dim)):
                self.weight_loader(param, part, sid)
            return
        rows = self.q_rows_per_head * D
        q = self.num_heads * rows
        if shard_id == "q":  # padding slots (uneven split) repeat the rank's last head
            if loaded_weight.shape[output_dim] != self.total_num_heads * rows:
                raise ValueError(f"shape mismatch: q tensor {tuple(loaded_weight.shape)} has "
                                 f"not {self.total_num_heads} heads of {rows} rows")
            self._copy_heads(weight_view(param), loaded_weight, output_dim, 0, self.q_head_ids,
                             rows)
            return
        if shard_id not in ("k", "v"):
            raise ValueError(f"QKV shard_id must be 'q', 'k' or 'v', got {shard_id!r}")
        if loaded_weight.shape[output_dim] != self.total_num_kv_heads * D:
            raise ValueError(f"shape mismatch: {shard_id} tensor {tuple(loaded_weight.shape)} "
                             f"has not {self.total_num_kv_heads} heads of {D}")
        base = q if shard_id == "k" else q + self.num_kv_heads * D
        self._copy_heads(weight_view(param), loaded_weight, output_dim, base, self.kv_head_ids, D)


class RowParallelLinear(LinearBase):
    """Input features split over ranks: ``Y = sum_rank X_rank @ A_rank`` (one all-reduce)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        input_is_parallel: bool = True,
        reduce_results: bool = True,
        params_dtype: Optional[torch.dtype] = None,
        quant_config: Optional[QuantizationConfig] = None,
        prefix: str = "",
        input_blocks: Optional[List[Optional[int]]] = None,
        block_size: int = 1,
    ):
        """``input_blocks`` (an uneven split, e.g. ``QKVParallelLinear.o_proj_input_blocks``):
        the global input block (of ``block_size`` features) behind each local block, ``None``
        for a padding block whose columns stay zero; without it, an even split."""
        super().__init__(input_size, output_size, params_dtype, quant_config, prefix)
        self.input_is_parallel = input_is_parallel
        self.reduce_results = reduce_results
        self.input_blocks = list(input_blocks) if input_blocks is not None else None
        self.block_size = block_size
        if self.input_blocks is None:
            self.input_size_per_partition = divide(input_size, self.tp_size)
        else:
            if not input_is_parallel:
                raise ValueError("input_blocks needs input_is_parallel=True")
            self._check_granularity(len(self.input_blocks) * block_size, block_size)
            self.input_size_per_partition = len(self.input_blocks) * block_size
        self._create(self.input_size_per_partition, [output_size], bias, output_size)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None
    ) -> None:
        input_dim = getattr(param, "input_dim", None)
        if input_dim is None:
            copy_checked(weight_view(param), loaded_weight)
        elif self.input_blocks is None:
            copy_checked(weight_view(param), shard_of(loaded_weight, input_dim, self.tp_rank,
                                              self.tp_size))
        else:
            if loaded_weight.shape[input_dim] != self.input_size:
                raise ValueError(f"shape mismatch: {tuple(loaded_weight.shape)} has not "
                                 f"{self.input_size} input features in dim {input_dim}")
            weight_view(param).zero_()  # padding blocks add nothing
            bs = self.block_size
            for local, block, count in consecutive_runs(self.input_blocks):
                copy_checked(weight_view(param).narrow(input_dim, local * bs, count * bs),
                             loaded_weight.narrow(input_dim, block * bs, count * bs))

    push_partial = False
    """Set by a decoder layer whose next step reduces this layer's partial sums itself
    (``reduce_results=False``, then ``RMSNorm(.., reduce=True)``): a batch-1 GEMV then
    pushes them to the custom all-reduce from its epilogue (``comm.custom_path``)."""

    def forward(self, x: torch.Tensor, act_fn: Optional[nn.Module] = None) -> torch.Tensor:
        """``act_fn``: a gated activation (``layers/activation``) that ``x``, a
        ``[.., 2I]`` gate_up output, goes through first; fused into the batch-1 GEMV
        where the quant method can (``apply_fused``)."""
        if not self.input_is_parallel and self.tp_size > 1:
            if act_fn is not None:
                raise ValueError("a gated input must already be split over the ranks")
            x = x.chunk(self.tp_size, dim=-1)[self.tp_rank]  # [.., in / tp]
        # The bias is added once, on rank 0, so the sum over ranks carries it once.
        bias = self.bias if self.tp_rank == 0 else None
        sink = None
        if self.push_partial and not self.reduce_results and bias is None:
            sink = custom_path()
        if act_fn is not None or sink is not None:
            y = self.quant_method.apply_fused(self, x, bias, act_fn, sink)  # [.., out] partial
        else:
            y = self.quant_method.apply(self, x, bias)  # [.., out] partial sum
        if self.reduce_results and self.tp_size > 1:
            y = tensor_model_parallel_all_reduce(y)
        return y

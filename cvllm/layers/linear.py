"""Parallel linear layers: each owns its TP sharding and delegates the math.

Built by the model classes at construction. A layer reads ``tp_rank`` / ``tp_size``
from ``distributed.parallel_state`` once, asks the ``QuantizationConfig`` (or defaults to
``UnquantizedLinearMethod``) to create this rank's parameters, and gives each parameter a
``weight_loader(param, loaded_weight, shard_id=None)`` that cuts this rank's slice out of
the full checkpoint tensor. Models never slice weights; ``RowParallelLinear`` alone calls
a collective (through ``distributed/comm.py``).

Sharding (vLLM's): Column* split the output features, Row splits the input features;
QKV splits heads, and replicates KV heads when tp_size exceeds their number.
"""

from __future__ import annotations

from typing import List, Optional, Union

import torch
from torch import nn

from cvllm.distributed import parallel_state
from cvllm.distributed.comm import (
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from cvllm.layers.utils import copy_checked, divide
from cvllm.quantization.base import LinearMethodBase, QuantizationConfig, set_weight_attrs
from cvllm.quantization.unquantized import UnquantizedLinearMethod


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
        method = quant_config.get_quant_method(self, prefix) if quant_config is not None else None
        self.quant_method: LinearMethodBase = method or UnquantizedLinearMethod()

    def _create(
        self, in_per_partition: int, out_partition_sizes: List[int], bias: bool, bias_size: int
    ) -> None:
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
            self.bias = nn.Parameter(
                torch.empty(bias_size, dtype=self.params_dtype), requires_grad=False
            )  # [out]
            set_weight_attrs(self.bias, {"output_dim": 0, "weight_loader": self.weight_loader})
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
        copy_checked(param.data, loaded_weight)

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
            size = param.shape[output_dim]
            loaded_weight = loaded_weight.narrow(output_dim, self.tp_rank * size, size)
        copy_checked(param.data, loaded_weight)

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
            copy_checked(param.data, loaded_weight)
            return
        if shard_id is None:  # a pre-fused checkpoint tensor: split it and load each part
            for i, part in enumerate(loaded_weight.split(self.output_sizes, dim=output_dim)):
                self.weight_loader(param, part, i)
            return
        size = divide(self.output_sizes[shard_id], self.tp_size)
        offset = divide(sum(self.output_sizes[:shard_id]), self.tp_size)
        dst = param.data.narrow(output_dim, offset, size)
        copy_checked(dst, loaded_weight.narrow(output_dim, self.tp_rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection, split by heads; ``shard_id`` is ``'q'``, ``'k'`` or ``'v'``."""

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
    ):
        tp_size = parallel_state.get_tensor_model_parallel_world_size()
        self.head_size = head_size
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads or total_num_heads
        self.num_heads = divide(total_num_heads, tp_size)
        if tp_size >= self.total_num_kv_heads:
            self.num_kv_heads = 1
            self.num_kv_head_replicas = divide(tp_size, self.total_num_kv_heads)
        else:
            self.num_kv_heads = divide(self.total_num_kv_heads, tp_size)
            self.num_kv_head_replicas = 1
        q_out, kv_out = (
            self.num_heads * head_size * tp_size,
            self.num_kv_heads * head_size * tp_size,
        )
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

    def _shard(self, shard_id: str):
        """(offset in this rank's param, width, start in the checkpoint tensor) of a shard."""
        q, kv = self.num_heads * self.head_size, self.num_kv_heads * self.head_size
        if shard_id == "q":
            return 0, q, self.tp_rank * q
        kv_rank = self.tp_rank // self.num_kv_head_replicas
        if shard_id == "k":
            return q, kv, kv_rank * kv
        if shard_id == "v":
            return q + kv, kv, kv_rank * kv
        raise ValueError(f"QKV shard_id must be 'q', 'k' or 'v', got {shard_id!r}")

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Union[str, None] = None
    ) -> None:
        output_dim = getattr(param, "output_dim", None)
        if output_dim is None:
            copy_checked(param.data, loaded_weight)
            return
        if shard_id is None:  # a pre-fused checkpoint qkv tensor
            sizes = [self.total_num_heads * self.head_size] + [
                self.total_num_kv_heads * self.head_size
            ] * 2
            for sid, part in zip("qkv", loaded_weight.split(sizes, dim=output_dim)):
                self.weight_loader(param, part, sid)
            return
        offset, size, start = self._shard(shard_id)
        dst = param.data.narrow(output_dim, offset, size)
        copy_checked(dst, loaded_weight.narrow(output_dim, start, size))


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
    ):
        super().__init__(input_size, output_size, params_dtype, quant_config, prefix)
        self.input_is_parallel = input_is_parallel
        self.reduce_results = reduce_results
        self.input_size_per_partition = divide(input_size, self.tp_size)
        self._create(self.input_size_per_partition, [output_size], bias, output_size)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None
    ) -> None:
        input_dim = getattr(param, "input_dim", None)
        if input_dim is not None:
            size = param.shape[input_dim]
            loaded_weight = loaded_weight.narrow(input_dim, self.tp_rank * size, size)
        copy_checked(param.data, loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel and self.tp_size > 1:
            x = x.chunk(self.tp_size, dim=-1)[self.tp_rank]  # [.., in / tp]
        # The bias is added once, on rank 0, so the sum over ranks carries it once.
        bias = self.bias if self.tp_rank == 0 else None
        y = self.quant_method.apply(self, x, bias)  # [.., out] partial sum
        if self.reduce_results and self.tp_size > 1:
            y = tensor_model_parallel_all_reduce(y)
        return y

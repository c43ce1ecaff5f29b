"""UnquantizedLinearMethod: a plain ``[out, in]`` weight in the model dtype.

Created by each parallel linear when no ``QuantizationConfig`` applies to it. A single
CUDA row (batch-1 decode) goes to ``kernels/gemv.py``, which streams the weight at a
higher fraction of the bandwidth than cuBLAS does at these shapes; everything else is
``F.linear``.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, List, Optional

import torch
import torch.nn.functional as F

from cvllm.quantization.base import (
    EmbeddingMethodBase, LinearMethodBase, MoEMethodBase, act_then, set_weight_attrs,
)
from cvllm.utils import tuning



class UnquantizedLinearMethod(LinearMethodBase):
    def create_weights(
        self,
        layer: torch.nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: List[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        weight = torch.nn.Parameter(
            torch.empty(
                sum(output_partition_sizes), input_size_per_partition, dtype=params_dtype
            ),  # [out, in]
            requires_grad=False,
        )
        set_weight_attrs(weight, {"input_dim": 1, "output_dim": 0})
        set_weight_attrs(weight, extra_weight_attrs)
        layer.register_parameter("weight", weight)

    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        if x.is_cuda:
            from cvllm.kernels import gemv as g

            if g.use_gemv(x, layer.weight) and (bias is None or bias.dtype == x.dtype):
                return g.gemv(x, layer.weight, bias)
        return F.linear(x, layer.weight, bias)

    def host_linear(self, layer: torch.nn.Module, act_fn: Optional[torch.nn.Module] = None
                    ) -> Callable[[torch.Tensor], torch.Tensor]:
        if layer.weight.is_cuda:  # apply's GEMV choices
            return super().host_linear(layer, act_fn)
        fn = functools.partial(F.linear, weight=layer.weight, bias=layer.bias)
        return fn if act_fn is None else act_then(act_fn, fn)  # apply_fused off CUDA

    def apply_fused(self, layer: torch.nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor],
                    act_fn: Optional[torch.nn.Module], sink: Any) -> torch.Tensor:
        """``apply(layer, act_fn(x), bias)`` (``act_fn``: a gated activation, ``x`` a
        gate_up output; or None), where a batch-1 GEMV may apply the activation to its
        input itself (``CVLLM_GEMV_ACT``) and / or push its rows to ``sink``'s reduction
        (a ``CustomAllReduce``, which then expects the returned tensor next)."""
        if x.is_cuda:
            from cvllm.kernels import gemv as g

            w = layer.weight
            bias_ok = bias is None or bias.dtype == x.dtype
            fuse = tuning.current().gemv_act  # one kernel fewer per MLP (docs/kernels.md)
            act = getattr(act_fn, "kernel_activation", None) if fuse else None
            if act is not None and not (bias_ok and g.use_gemv(x, w, gated=True)):
                act = None
            if act_fn is not None and act is None:
                x = act_fn(x)  # [.., I]
            if bias_ok and g.use_gemv(x, w, gated=act is not None):
                target = None
                if sink is not None and bias is None:
                    target = sink.push_target(w.shape[0], x.dtype)
                y = g.gemv(x, w, bias, act=act, push=target)
                if target is not None:
                    sink.mark_pushed(y)
                return y
        elif act_fn is not None:
            x = act_fn(x)  # [.., I]
        return self.apply(layer, x, bias)


class UnquantizedEmbeddingMethod(EmbeddingMethodBase):
    """Plain ``[V_per_partition, hidden]`` rows in the model dtype; as an LM head, the
    unquantized linear (batch-1 GEMV on CUDA)."""

    _linear = UnquantizedLinearMethod()

    def create_weights(self, layer: torch.nn.Module, num_rows: int, embedding_dim: int,
                       params_dtype: torch.dtype, **extra_weight_attrs: Any) -> None:
        weight = torch.nn.Parameter(torch.empty(num_rows, embedding_dim, dtype=params_dtype),
                                    requires_grad=False)  # [V_per_partition, hidden]
        set_weight_attrs(weight, {"output_dim": 0})
        set_weight_attrs(weight, extra_weight_attrs)
        layer.register_parameter("weight", weight)

    def embedding(self, layer: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, layer.weight)  # [T, hidden]

    def apply(self, layer: torch.nn.Module, x: torch.Tensor,
              bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self._linear.apply(layer, x, bias)


class UnquantizedMoEMethod(MoEMethodBase):
    """Plain expert weights in the model dtype: the Triton grouped GEMM on CUDA
    (``kernels/fused_moe.py``), its torch reference elsewhere."""

    def create_weights(self, layer: torch.nn.Module, num_experts: int, hidden_size: int,
                       inter_per_partition: int, params_dtype: torch.dtype,
                       **extra_weight_attrs: Any) -> None:
        inter = inter_per_partition
        layer.w13_weight = torch.nn.Parameter(
            torch.empty(num_experts, 2 * inter, hidden_size, dtype=params_dtype),
            requires_grad=False)  # [E, 2I/tp, H]
        layer.w2_weight = torch.nn.Parameter(
            torch.empty(num_experts, hidden_size, inter, dtype=params_dtype),
            requires_grad=False)  # [E, H, I/tp]
        for param in (layer.w13_weight, layer.w2_weight):
            set_weight_attrs(param, extra_weight_attrs)

    def apply(self, layer: torch.nn.Module, hidden: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, activation: str) -> torch.Tensor:
        if hidden.is_cuda:
            from cvllm.kernels.fused_moe import fused_moe

            return fused_moe(hidden, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids,
                             activation)
        from cvllm.kernels.reference.fused_moe import fused_moe_ref

        return fused_moe_ref(hidden, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids,
                             activation)

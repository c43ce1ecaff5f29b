"""UnquantizedLinearMethod: a plain ``[out, in]`` weight in the model dtype.

Created by each parallel linear when no ``QuantizationConfig`` applies to it. A single
CUDA row (batch-1 decode) goes to ``kernels/gemv.py``, which streams the weight at a
higher fraction of the bandwidth than cuBLAS does at these shapes; everything else is
``F.linear``.
"""

from __future__ import annotations

import os
from typing import Any, List, Optional

import torch
import torch.nn.functional as F

from cvllm.quantization.base import LinearMethodBase, set_weight_attrs

FUSE_ACT = os.environ.get("CVLLM_GEMV_ACT", "1").strip() != "0"
"""Whether a batch-1 GEMV applies a gated activation to its input itself (one kernel
fewer per MLP); ``CVLLM_GEMV_ACT=0`` runs the activation kernel first (comparisons)."""


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
            act = getattr(act_fn, "kernel_activation", None) if FUSE_ACT else None
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

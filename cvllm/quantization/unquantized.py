"""UnquantizedLinearMethod: a plain ``[out, in]`` weight in the model dtype.

Created by each parallel linear when no ``QuantizationConfig`` applies to it. A single
CUDA row (batch-1 decode) goes to ``kernels/gemv.py``, which streams the weight at a
higher fraction of the bandwidth than cuBLAS does at these shapes; everything else is
``F.linear``.
"""

from __future__ import annotations

from typing import Any, List, Optional

import torch
import torch.nn.functional as F

from cvllm.quantization.base import LinearMethodBase, set_weight_attrs


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

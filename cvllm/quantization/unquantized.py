"""UnquantizedLinearMethod: a plain ``[out, in]`` weight in the model dtype.

Created by each parallel linear when no ``QuantizationConfig`` applies to it.
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
        return F.linear(x, layer.weight, bias)

"""RMSNorm, computed in float32 like Hugging Face, with an optional fused residual add.

Built by the model classes; the weight is replicated on every rank.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
from torch import nn

from cvllm.layers.utils import default_weight_loader
from cvllm.quantization.base import set_weight_attrs


class RMSNorm(nn.Module):
    def __init__(
        self, hidden_size: int, eps: float = 1e-6, params_dtype: Optional[torch.dtype] = None
    ):
        super().__init__()
        self.variance_epsilon = eps
        dtype = params_dtype or torch.get_default_dtype()
        self.weight = nn.Parameter(
            torch.ones(hidden_size, dtype=dtype), requires_grad=False
        )  # [hidden]
        set_weight_attrs(self.weight, {"weight_loader": default_weight_loader})

    def forward(
        self, x: torch.Tensor, residual: Optional[torch.Tensor] = None
    ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        """``norm(x)``, or with ``residual``: ``(norm(x + residual), x + residual)``.
        The add is in the model dtype, as in HF's decoder layers."""
        if residual is not None:
            x = x + residual
            residual = x
        dtype = x.dtype
        xf = x.float()
        variance = xf.pow(2).mean(-1, keepdim=True)
        out = self.weight * (xf * torch.rsqrt(variance + self.variance_epsilon)).to(dtype)
        return out if residual is None else (out, residual)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.variance_epsilon}"

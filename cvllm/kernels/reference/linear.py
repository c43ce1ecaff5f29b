"""References of the MLP's dense kernels: the gated activations (``kernels/activation.py``)
and the batch-1 GEMV (``kernels/gemv.py``)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

ACT_AND_MUL = ("silu", "gelu", "gelu_tanh")


def act_and_mul_ref(x: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """``act(x[.., :I]) * x[.., I:]`` in x's dtype (torch's per-op roundings). Oracle of
    ``kernels/activation.py``."""
    inter = x.shape[-1] // 2
    gate, up = x[..., :inter], x[..., inter:]
    if activation == "silu":
        return F.silu(gate) * up  # [.., I]
    if activation in ("gelu", "gelu_tanh"):
        approximate = "tanh" if activation == "gelu_tanh" else "none"
        return F.gelu(gate, approximate=approximate) * up  # [.., I]
    raise ValueError(f"unsupported activation {activation!r}; supported: {ACT_AND_MUL}")


# ----------------------------------------------------------------- batch-1 linear
def gemv_ref(x: torch.Tensor, weight: torch.Tensor,
             bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x @ weight^T (+ bias)`` summed in float32 and rounded once to x's dtype: the
    contract of ``kernels/gemv.gemv`` (one row of ``F.linear``)."""
    y = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    return y.to(x.dtype)

"""References of ``kernels/rmsnorm.py`` and ``kernels/allreduce.py`` (the all-reduce,
alone or fused with the decoder's residual add + RMSNorm)."""

from __future__ import annotations

from typing import Optional, Sequence

import torch


def rms_norm_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: Optional[torch.Tensor] = None,
    offset: bool = False,
):
    """``norm(x)``, or ``(norm(x + residual), x + residual)``, outputs in x's dtype: the
    add rounds to x's dtype and the norm is taken of the rounded sum (HF's decoder
    layers). ``offset=False`` (Llama): ``w * round(normed)``; ``offset=True`` (Gemma):
    ``normed * (1 + w)`` in float32, rounded once. Oracle of ``kernels/rmsnorm.py``."""
    if residual is not None:
        x = x + residual
        residual = x
    dtype = x.dtype
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if offset:
        out = (normed * (1.0 + weight.float())).to(dtype)
    else:
        out = (weight.float() * normed.to(dtype).float()).to(dtype)
    return out if residual is None else (out, residual)


# ----------------------------------------------------------------- all-reduce
def all_reduce_ref(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """The sum of every rank's tensor, in float32 in rank order, rounded once to the
    inputs' dtype. Oracle of ``kernels/allreduce.py`` without the norm."""
    acc = torch.zeros(parts[0].shape, dtype=torch.float32, device=parts[0].device)
    for p in parts:
        acc += p.float()
    return acc.to(parts[0].dtype)


def all_reduce_rms_norm_ref(parts: Sequence[torch.Tensor], residual: torch.Tensor,
                            weight: torch.Tensor, eps: float):
    """``rms_norm_ref(all_reduce_ref(parts), weight, eps, residual)``: what a rank gets
    from the all-reduce followed by the decoder's add + RMSNorm. Oracle of
    ``kernels/allreduce.py`` with the norm."""
    return rms_norm_ref(all_reduce_ref(parts), weight, eps, residual)

"""Small helpers shared by the layers and model files (no state)."""

from __future__ import annotations

import torch

TORCH_DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}


def torch_dtype(name: str) -> torch.dtype:
    """``ModelConfig.dtype`` (bf16 / f16 / f32) as a torch dtype."""
    if name not in TORCH_DTYPES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {', '.join(TORCH_DTYPES)}")
    return TORCH_DTYPES[name]


def divide(numerator: int, denominator: int) -> int:
    if numerator % denominator != 0:
        raise ValueError(f"{numerator} is not divisible by {denominator}")
    return numerator // denominator


def copy_checked(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy a (sliced) checkpoint tensor into a parameter (slice), converting dtype/device."""
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(
            f"shape mismatch: checkpoint tensor {tuple(src.shape)} vs parameter {tuple(dst.shape)}"
        )
    dst.copy_(src)


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    """Loader of an unsharded parameter (norm weights, replicated tensors)."""
    copy_checked(param.data, loaded_weight)

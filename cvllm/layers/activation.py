"""Gated activations on a fused ``[.., 2*d]`` gate_up projection: ``act(gate) * up``;
and plain ones (``get_act_fn``) for ungated MLPs. On CUDA the gated ones run the Triton
kernel ``kernels/activation.py`` (one pass, same roundings); elsewhere torch."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    kernel_activation = "silu"
    """Its name in ``kernels/activation.ACTIVATIONS`` (a GEMV may apply it to its input)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from cvllm.kernels.activation import act_and_mul

            return act_and_mul(x, "silu")  # [.., d]
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]  # [.., d]


class GeluAndMul(nn.Module):
    def __init__(self, approximate: str = "none"):
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ValueError(
                f"GeluAndMul approximate must be 'none' or 'tanh', got {approximate!r}"
            )
        self.approximate = approximate
        self.kernel_activation = "gelu_tanh" if approximate == "tanh" else "gelu"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from cvllm.kernels.activation import act_and_mul

            return act_and_mul(x, self.kernel_activation)
        d = x.shape[-1] // 2
        return F.gelu(x[..., :d], approximate=self.approximate) * x[..., d:]  # [.., d]

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"


_ACT_AND_MUL = {
    "silu": SiluAndMul,
    "swish": SiluAndMul,
    "gelu": lambda: GeluAndMul("none"),
    "gelu_pytorch_tanh": lambda: GeluAndMul("tanh"),
    "gelu_new": lambda: GeluAndMul("tanh"),
    "gelu_fast": lambda: GeluAndMul("tanh"),
}


def get_act_and_mul_fn(hidden_act: str) -> nn.Module:
    """The gated activation for a config's ``hidden_act``."""
    if hidden_act not in _ACT_AND_MUL:
        raise ValueError(
            f"unsupported hidden_act {hidden_act!r}; supported: {', '.join(sorted(_ACT_AND_MUL))}"
        )
    return _ACT_AND_MUL[hidden_act]()


# Plain (ungated) activations, for MLPs like Phi-2's fc1 -> act -> fc2.
_ACT = {
    "silu": nn.SiLU,
    "swish": nn.SiLU,
    "relu": nn.ReLU,
    "gelu": lambda: nn.GELU("none"),
    "gelu_pytorch_tanh": lambda: nn.GELU("tanh"),
    "gelu_new": lambda: nn.GELU("tanh"),
    "gelu_fast": lambda: nn.GELU("tanh"),
}


def get_act_fn(hidden_act: str) -> nn.Module:
    """The plain activation for a config's ``hidden_act``."""
    if hidden_act not in _ACT:
        raise ValueError(
            f"unsupported hidden_act {hidden_act!r}; supported: {', '.join(sorted(_ACT))}"
        )
    return _ACT[hidden_act]()

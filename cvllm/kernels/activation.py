"""Gated activations ``act(gate) * up`` over a fused ``[T, 2I]`` gate_up projection (Triton).

Called by ``layers/activation.SiluAndMul`` / ``GeluAndMul`` on CUDA tensors;
``kernels/reference/linear.act_and_mul_ref`` is the plain-torch version and the test oracle
(tests/kernels/test_activation.py, also run on the CPU under ``TRITON_INTERPRET=1``).
Nothing here keeps state between calls.

The ``[T, I]`` result is written in one pass, without the ``[T, I]`` temporaries of the
torch form. Math is float32 with torch's roundings for 16-bit inputs: ``act(gate)`` is
rounded to the input dtype before the multiply (torch rounds each op's result), so the
GPU output equals the CPU path up to the activation's last bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cvllm.kernels import pdl
from cvllm.kernels.pdl import gdc_enter

ACTIVATIONS = {"silu": 0, "gelu": 1, "gelu_tanh": 2}
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def activate(g, ACTIVATION: tl.constexpr):
    """``act(g)`` in float32 (ACTIVATION: a value of ``ACTIVATIONS``); also used by the
    batch-1 GEMV that applies the gated activation to its input (``kernels/gemv.py``)."""
    if ACTIVATION == 0:  # silu
        act = g / (1.0 + tl.exp(-g))
    elif ACTIVATION == 1:  # exact gelu
        act = 0.5 * g * (1.0 + tl.erf(g * 0.7071067811865476))
    else:  # tanh approximation: 0.5 g (1 + tanh(z)) = g sigmoid(2z), accurate for any z
        z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        act = g / (1.0 + tl.exp(-2.0 * z))
    return act


@triton.jit
def _act_and_mul_kernel(
    x_ptr, out_ptr, inter, stride_x, stride_out,
    ACTIVATION: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr,
):
    """Row ``pid0``, columns ``pid1 * BLOCK ..``: ``out = act(x[:, :I]) * x[:, I:]``."""
    if PDL:  # x comes from the kernel before (this one is resident before it ends)
        gdc_enter(EARLY)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = gate.dtype
    act = activate(gate.to(tl.float32), ACTIVATION)
    out = act.to(dtype).to(tl.float32) * up
    tl.store(out_ptr + row * stride_out + cols, out.to(dtype), mask=mask)


def act_and_mul(x: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """``x [.., 2I]`` (gate first, then up) -> ``act(gate) * up`` ``[.., I]`` in x's dtype;
    the contract of ``reference.act_and_mul_ref``. ``activation``: silu, gelu (exact) or
    gelu_tanh."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"unsupported activation {activation!r}; supported: {list(ACTIVATIONS)}")
    if x.dim() < 1 or x.shape[-1] % 2:
        raise ValueError(f"x must be [.., 2I]; got {tuple(x.shape)}")
    if x.dtype not in _DTYPES:
        raise ValueError(f"x dtype must be one of {_DTYPES}; got {x.dtype}")
    inter = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * inter)  # [R, 2I]
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = x.new_empty(*x.shape[:-1], inter)  # [.., I]
    rows = x2.shape[0]
    if rows == 0 or inter == 0:
        return out
    block = min(triton.next_power_of_2(inter), 1024)
    _act_and_mul_kernel[(rows, triton.cdiv(inter, block))](
        x2, out.view(rows, inter), inter, x2.stride(0), inter,
        ACTIVATION=ACTIVATIONS[activation], BLOCK=block, PDL=pdl.enabled(x),
        EARLY=pdl.early_trigger(x, "act"), num_warps=4,
        **pdl.launch_args(x),
    )
    return out

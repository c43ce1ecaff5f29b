"""RMSNorm with an optional fused residual add, one row per Triton program (Triton).

Called by ``layers/layernorm.RMSNorm`` / ``GemmaRMSNorm`` on CUDA tensors;
``kernels/reference/norms.rms_norm_ref`` is the plain-torch version and the test oracle
(tests/kernels/test_rmsnorm.py, also run on the CPU under ``TRITON_INTERPRET=1``).
Nothing here keeps state between calls.

One program loads its whole row once (``BLOCK = next_pow2(hidden)``, up to
``MAX_HIDDEN``), so the residual sum and the normalised output leave in a single pass
over memory. The math is float32, with the roundings of the torch layers, so the GPU
output equals the CPU path up to the order of the mean's sum:

- the residual add is rounded to the model dtype (HF adds in the model dtype), and the
  norm is taken of that rounded sum;
- ``offset=False`` (Llama): ``w * round(x * rsqrt(mean(x^2) + eps))``, the product
  rounded again;
- ``offset=True`` (Gemma): ``round(x * rsqrt(mean(x^2) + eps) * (1 + w))``, float32
  throughout, rounded once.

``q8_wps`` (one row, batch-1 decode): the program also writes its output row in the int8
form the batch-1 GGUF GEMV reads (``kernels/quant/ggml_q8.q8_store``, after a
barrier, from the row it stored: the same bits as that GEMV's own rounding) and attaches
it to the output tensor (``quant/q8form.attach_q8``), so the GEMV that takes this output
next (a layer's QKV or gate_up projection, ``layers/layernorm.pair_norm_outputs``)
skips the rounding in every one of its programs.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
import triton
import triton.language as tl

from cvllm.kernels import pdl
from cvllm.kernels.device import INTERPRETED
from cvllm.kernels.pdl import gdc_enter
from cvllm.kernels.quant.ggml_q8 import q8_store
from cvllm.kernels.quant.q8form import attach_q8, q8_buffers

MAX_HIDDEN = 65536
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, q_ptr, s_ptr,
    N, eps,
    stride_x, stride_res, stride_out, stride_res_out,
    HAS_RESIDUAL: tl.constexpr, OFFSET: tl.constexpr, BLOCK: tl.constexpr,
    PDL: tl.constexpr, Q8_WPS: tl.constexpr, Q8_NSUB: tl.constexpr, ASM: tl.constexpr,
    EARLY: tl.constexpr,
):
    """Row ``pid``: ``out = norm(x [+ res]) * w`` (see the module docstring for roundings);
    with HAS_RESIDUAL also ``res_out = x + res``. ``res_out`` may alias ``res`` and ``out``
    may alias ``x``: every element is read before its own row is written. The weight (a
    parameter no kernel writes) is read before the PDL wait, off the critical path.
    ``Q8_WPS`` (4 or 8; one row): also the stored row in the GGUF GEMV's int8 form at
    ``q_ptr`` / ``s_ptr`` (``q8_store``, ``Q8_NSUB`` sub-blocks of 32; ``ASM``: dp4a in
    PTX)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if PDL:  # x comes from the kernel before (this one is resident before it ends)
        gdc_enter(EARLY)
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0).to(tl.float32)
        summed = (x + r).to(dtype)
        tl.store(res_out_ptr + row * stride_res_out + cols, summed, mask=mask)
        x = summed.to(tl.float32)
    var = tl.sum(x * x, axis=0) / N
    normed = x * tl.rsqrt(var + eps)
    if OFFSET:
        y = normed * (1.0 + w)
    else:
        y = normed.to(dtype).to(tl.float32) * w
    tl.store(out_ptr + row * stride_out + cols, y.to(dtype), mask=mask)
    if Q8_WPS > 0:
        tl.debug_barrier()  # the row is stored: every thread reads back what was written
        q8_store(out_ptr + row * stride_out, q_ptr, s_ptr, 0, N, Q8_NSUB,
                 N == Q8_NSUB * 32, ASM, 0, Q8_WPS)


def _rows(t: torch.Tensor, hidden: int) -> torch.Tensor:
    """``t`` as ``[R, hidden]`` with unit stride along hidden (a view where one exists)."""
    t2 = t.reshape(-1, hidden)  # [R, hidden]
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _check_inputs(x, weight, residual, out, residual_out) -> None:
    """Shapes, dtypes and devices the kernel relies on; raises ValueError."""
    if x.dim() < 1 or weight.dim() != 1 or x.shape[-1] != weight.shape[0]:
        raise ValueError(f"x [.., N] and weight [N] disagree: {tuple(x.shape)}, "
                         f"{tuple(weight.shape)}")
    if x.dtype not in _DTYPES or weight.dtype not in _DTYPES:
        raise ValueError(f"x/weight dtype must be one of {_DTYPES}; got {x.dtype}, {weight.dtype}")
    if x.shape[-1] > MAX_HIDDEN:
        raise ValueError(f"hidden size {x.shape[-1]} exceeds the one-block limit {MAX_HIDDEN}")
    for name, t in (("residual", residual), ("out", out), ("residual_out", residual_out)):
        if t is None:
            continue
        if t.shape != x.shape or t.dtype != x.dtype:
            raise ValueError(f"{name} must match x {tuple(x.shape)} {x.dtype}; got "
                             f"{tuple(t.shape)} {t.dtype}")
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}")
    if weight.device != x.device:
        raise ValueError(f"weight is on {weight.device}, x on {x.device}")
    if weight.stride(0) != 1:
        raise ValueError("weight must be contiguous")
    if residual is None and residual_out is not None:
        raise ValueError("residual_out needs residual")


def _out_rows(name: str, t: torch.Tensor, hidden: int) -> torch.Tensor:
    """An output as a ``[R, hidden]`` view; the kernel writes through it."""
    try:
        t2 = t.view(-1, hidden)  # [R, N]
    except RuntimeError:
        t2 = None
    if t2 is None or t2.stride(-1) != 1:
        raise ValueError(f"{name} must be viewable as [rows, {hidden}] with unit stride")
    return t2


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: Optional[torch.Tensor] = None,
    offset: bool = False,
    out: Optional[torch.Tensor] = None,
    residual_out: Optional[torch.Tensor] = None,
    q8_wps: int = 0,
    site: str = "norm",
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """``norm(x)`` or, with ``residual``, ``(norm(x + residual), x + residual)``; the
    contract of ``reference.rms_norm_ref``. ``x [.., N]``, ``weight [N]``; outputs in x's
    dtype, new tensors unless ``out`` / ``residual_out`` are given (they may be ``x`` /
    ``residual`` for an in-place update). ``q8_wps`` (4 or 8): for one row of a multiple
    of 32 elements in bf16 / fp16, the output also carries its int8 form for a GGUF GEMV
    of that many words a sub-block (module docstring); other calls ignore it."""
    _check_inputs(x, weight, residual, out, residual_out)
    hidden = x.shape[-1]
    out = torch.empty_like(x, memory_format=torch.contiguous_format) if out is None else out
    if residual is not None and residual_out is None:
        residual_out = torch.empty_like(x, memory_format=torch.contiguous_format)
    x2, o2 = _rows(x, hidden), _out_rows("out", out, hidden)  # [R, N]
    r2 = _rows(residual, hidden) if residual is not None else x2
    ro2 = _out_rows("residual_out", residual_out, hidden) if residual_out is not None else o2
    if x2.shape[0] > 0:
        block = triton.next_power_of_2(hidden)
        q8 = q8_wps in (4, 8) and x2.shape[0] == 1 and hidden % 32 == 0 and x.dtype in (
            torch.float16, torch.bfloat16)
        words = steps = o2
        if q8:
            words, steps = q8_buffers(hidden, x.device)
        _rms_norm_kernel[(x2.shape[0],)](
            x2, r2, weight, o2, ro2, words, steps, hidden, float(eps),
            x2.stride(0), r2.stride(0), o2.stride(0), ro2.stride(0),
            HAS_RESIDUAL=residual is not None, OFFSET=offset, BLOCK=block, PDL=pdl.enabled(x),
            Q8_WPS=q8_wps if q8 else 0, Q8_NSUB=triton.next_power_of_2(hidden // 32) if q8
            else 1, ASM=not INTERPRETED, EARLY=pdl.early_trigger(x, site),
            num_warps=min(max(block // 512, 1), 16),
            **pdl.launch_args(x),
        )
        if q8:
            attach_q8(out, q8_wps, words, steps)
    return out if residual is None else (out, residual_out)

"""The int8 form of one activation row that the batch-1 GGUF GEMV reads
(``ggml_cuda``'s ``gemv_i8`` path): made by ``quantize_q8``'s kernel of its own, or carried
on the row itself (``attach_q8``) when the kernel that wrote the row wrote that form too
(the RMSNorm kernel, ``kernels/rmsnorm.py``, ``q8_wps``); the GEMV then skips its own
rounding, which would give the same bits."""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton

from cvllm.kernels import pdl
from cvllm.kernels.device import INTERPRETED
from cvllm.kernels.quant.ggml_q8 import ggml_q8_kernel

_Q8_ATTR = "ggml_q8"
"""The attribute a tensor carries its int8 form under (``attach_q8``)."""


def _version(t: torch.Tensor) -> int:
    """``t``'s in-place write count; -1 for an inference tensor (``torch.inference_mode``,
    the engine's steps), which counts none: there only the identity of ``t`` holds."""
    return -1 if t.is_inference() else t._version


def attach_q8(t: torch.Tensor, wps: int, words: torch.Tensor, steps: torch.Tensor) -> None:
    """Record on ``t`` (one row) its int8 form for GEMVs of ``wps`` words a sub-block, as
    ``quantize_q8`` would return it (the RMSNorm kernel writes it beside its output:
    ``kernels/rmsnorm.py``). Valid while ``t`` is not modified in place (its version)."""
    setattr(t, _Q8_ATTR, (wps, _version(t), words, steps))


def attached_q8(t: torch.Tensor, wps: int) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """``t``'s int8 form from ``attach_q8`` for ``wps``-word sub-blocks, or None (none
    attached, another form, or ``t`` written since)."""
    got = getattr(t, _Q8_ATTR, None)
    if got is None or got[0] != wps or got[1] != _version(t):
        return None
    return got[2], got[3]


Q8_NSUB = 32
"""Sub-blocks (of 32 elements) a ``ggml_q8_kernel`` program rounds: one word of eight
elements a thread at 4 warps."""


def q8_buffers(k: int, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    """Empty ``(words [2, K / 8] int32, steps [2, K / 32] float32)``: the int8 form of a
    row of ``K`` (``quantize_q8``'s, the RMSNorm kernel's)."""
    return (torch.empty(2, k // 8, dtype=torch.int32, device=device),
            torch.empty(2, k // 32, dtype=torch.float32, device=device))


def quantize_q8(x2: torch.Tensor, k: int, act: int = 0, wps: int = 4
                ) -> Tuple[torch.Tensor, torch.Tensor]:
    """One row ``x2 [1, K]`` (``[1, 2K]`` gate_up with ``act``) in ``ggml_gemv_i8_kernel``'s
    int8 form for weights of ``wps`` words a sub-block: words ``[2, K / 8]`` int32 (one
    run of ``K / 4`` for ``wps`` 8) and steps ``[2, K / 32]`` float32
    (``ggml_q8.ggml_q8_kernel``; K a multiple of 32)."""
    words, steps = q8_buffers(k, x2.device)
    ggml_q8_kernel[(triton.cdiv(k, Q8_NSUB * 32),)](
        x2, words, steps, k, NSUB=Q8_NSUB, EVEN_K=k % (Q8_NSUB * 32) == 0,
        ASM=not INTERPRETED, ACT=act, PDL=pdl.enabled(x2), WPS=wps,
        EARLY=pdl.early_trigger(x2, "q8"), num_warps=4,
        **pdl.launch_args(x2))
    return words, steps

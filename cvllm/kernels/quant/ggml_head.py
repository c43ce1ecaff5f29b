"""The LM head of a GGUF model at one row on CUDA: the int8 GEMV with its largest logits
recomputed exactly.

An LM head is the largest single weight of a decode step (an 8B model's Q6_K head:
431 MB of 4.9 GB) and the float GEMV it took at one row (``ggml_cuda``'s ``exact``
weights) is held by its own arithmetic, where the int8 GEMV streams it (about 1.4x faster
on an H200; docs/kernels.md, ``CVLLM_GGML_INT8_HEAD``). The int8 GEMV rounds x per 16
or 32 elements, which moves each logit by a little; so, as the CPU backend does for its
narrower products (``quantization/gguf_methods.py``, ``REFINE_TOP``), each row's ``REFINE``
largest logits are then recomputed without the rounding and written over the rounded
ones: greedy choices and the top log-probabilities see the exact head, the rest of the
distribution the int8 one.

``head_linear`` does that in four launches, all graph-safe (fixed shapes): the int8 GEMV,
``topk_rows`` (two Triton kernels: each program's ``REFINE`` largest of its 2,048
columns, then the row's from those; each by two small top-k's, over group maxima and then
the chosen groups) and the float GEMV on the chosen rows only, at the
tiles of the whole head, each written over its own logit: the exact path's values, bit
for bit. Elsewhere (more rows, a type without the int8 GEMV, ``CVLLM_GGML_INT8_HEAD=0``)
it is ``ggml_cuda.linear``: the exact float path.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from cvllm.kernels.device import sms_of
from cvllm.kernels.quant import ggml_cuda as gc
from cvllm.kernels.quant.ggml_plan import choose_path
from cvllm.utils import tuning

REFINE = 16
"""Logits a row recomputed exactly (a power of two; the CPU backend's ``REFINE_TOP``)."""
_BLOCK = 2048
"""Columns a ``_topk_part_kernel`` program takes."""
_GROUP = 16
"""Neighbouring keys whose largest stands for them in a top-k's first pass."""


@triton.jit
def _keys(v, cols):
    """int64 keys ordered as the float32 values ``v`` are, ties by column, the column in
    the low 32 bits: the sign-magnitude bits of a float turned into a two's-complement
    order (negatives' magnitude bits flipped)."""
    bits = v.to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return (ordered.to(tl.int64) << 32) | cols.to(tl.int64)


@triton.jit
def _col_keys(row_ptr, cols, V):
    """The keys of columns ``cols`` (any shape) of one row; past ``V``: the smallest
    int64 (never among the largest)."""
    v = tl.load(row_ptr + cols, mask=cols < V, other=0.0).to(tl.float32)
    return tl.where(cols < V, _keys(v, cols), -9223372036854775807 - 1)


@triton.jit
def _topk_part_kernel(y_ptr, part_ptr, V, stride_y, R: tl.constexpr, BLOCK: tl.constexpr,
                      G: tl.constexpr):
    """Row ``pid0``, columns ``[pid1 * BLOCK, ..)``: the keys of its ``R`` largest into
    ``part [M, programs * R]``, largest first. Two small top-k's instead of one over
    ``BLOCK``: the ``R`` largest lie in the ``R`` groups of ``G`` neighbours with the
    largest maxima (a group outside them has ``R`` larger maxima, so ``R`` larger
    elements, above all of its own), whose ``R * G`` keys are read again (cached)."""
    row, part = tl.program_id(0), tl.program_id(1)
    row_ptr = y_ptr + row * stride_y
    keys = _col_keys(row_ptr, part * BLOCK + tl.arange(0, BLOCK), V)  # [BLOCK]
    top = tl.topk(tl.max(tl.reshape(keys, [BLOCK // G, G]), 1), R)  # [R] group maxima
    first = ((top & 0xFFFFFFFF) // G) * G  # [R] each group's first column
    cand = _col_keys(row_ptr, first[:, None] + tl.arange(0, G)[None, :], V)  # [R, G]
    cand = tl.where((top != -9223372036854775807 - 1)[:, None], cand,
                    -9223372036854775807 - 1)  # a group wholly past the row: none
    best = tl.topk(tl.reshape(cand, [R * G]), R)
    tl.store(part_ptr + (row * tl.num_programs(1) + part) * R + tl.arange(0, R), best)


@triton.jit
def _topk_merge_kernel(part_ptr, idx_ptr, n_part, R: tl.constexpr, PARTS: tl.constexpr,
                       BLOCK: tl.constexpr):
    """Row ``pid``: the columns of the ``R`` largest of its ``n_part`` parts' ``R`` keys
    each (``PARTS``: a power of two, at least ``n_part`` and ``R``), largest first; as in
    the part kernel, from the ``R`` parts with the largest maxima (a key's part is its
    column // ``BLOCK``)."""
    row = tl.program_id(0)
    row_ptr = part_ptr + row * n_part * R
    parts = tl.arange(0, PARTS)
    keys = tl.load(row_ptr + parts[:, None] * R + tl.arange(0, R)[None, :],
                   mask=(parts < n_part)[:, None], other=-9223372036854775807 - 1)
    top = tl.topk(tl.max(keys, 1), R)  # [R] part maxima
    first = ((top & 0xFFFFFFFF) // BLOCK) * R  # [R] each part's first key
    live = top != -9223372036854775807 - 1
    cand = tl.load(row_ptr + first[:, None] + tl.arange(0, R)[None, :], mask=live[:, None],
                   other=-9223372036854775807 - 1)  # [R, R]
    best = tl.topk(tl.reshape(cand, [R * R]), R)
    tl.store(idx_ptr + row * R + tl.arange(0, R), best & 0xFFFFFFFF)


def topk_rows(y: torch.Tensor, r: int = REFINE) -> torch.Tensor:
    """Column indices ``[M, r]`` (int64) of each row's ``r`` largest values of ``y [M, V]``
    (any float dtype, unit column stride, ``r`` a power of two, at most ``V``), largest
    first, ties to the higher column."""
    m, v = y.shape
    if (r < 1 or r & (r - 1) or r > min(v, _BLOCK // _GROUP) or y.stride(1) != 1
            or v >= 1 << 31):
        raise ValueError(f"topk_rows needs r a power of two <= min(V, {_BLOCK // _GROUP}), "
                         f"V < 2**31 and unit column stride; got r={r}, y {tuple(y.shape)} "
                         f"stride {y.stride()}")
    parts = triton.cdiv(v, _BLOCK)
    part = torch.empty(m, parts * r, dtype=torch.int64, device=y.device)
    idx = torch.empty(m, r, dtype=torch.int64, device=y.device)
    if m:
        _topk_part_kernel[(m, parts)](y, part, v, y.stride(0), R=r, BLOCK=_BLOCK, G=_GROUP,
                                      num_warps=4)
        _topk_merge_kernel[(m,)](part, idx, parts, R=r,
                                 PARTS=max(triton.next_power_of_2(parts), r), BLOCK=_BLOCK,
                                 num_warps=4)
    return idx


def takes_int8_head(x: torch.Tensor, w: gc.CudaGgmlWeight) -> bool:
    """Whether ``head_linear`` takes the int8 GEMV for ``x``: one row of a type (and, for
    Q6_K, a shape) the int8 GEMV takes, with at least ``REFINE`` output rows."""
    rows = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0
    return (tuning.current().ggml_int8_head and rows == 1 and w.shape[0] >= REFINE
            and choose_path(1, w.spec, False, w.shape, sms_of(x)) == "gemv_i8")


def head_linear(x: torch.Tensor, w: gc.CudaGgmlWeight,
                bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x [.., K] @ W^T (+ bias)`` for an LM head: at one row (``takes_int8_head``) the
    int8 GEMV with each row's ``REFINE`` largest logits recomputed by the float GEMV;
    otherwise ``ggml_cuda.linear``."""
    if not takes_int8_head(x, w):
        return gc.linear(x, w, bias)
    y = gc.linear(x, w, bias, path="gemv_i8")  # [.., N]
    y2 = y.view(1, -1)  # [1, N]
    idx = topk_rows(y2)  # [1, R]
    # the float GEMV again, on those rows only, at the whole head's tiles: the values the
    # exact path gives them, bit for bit
    gc.launch_gemv(x.reshape(1, -1), w, bias, y2, None, ids=idx.view(-1))
    return y

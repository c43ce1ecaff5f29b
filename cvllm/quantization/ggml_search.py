"""llama.cpp's K-quant scale searches and the float32 arithmetic of its C code, in torch.

Used by the GGUF block quantizers (``quantization/ggml_quantizer.py``, the only caller):
``make_qkx2`` (Q2_K, Q4_K, Q5_K), ``make_q3`` (Q3_K) and ``make_qx`` (Q6_K) pick each
group's scale (and min) and levels; ``f32``, ``rdiv``, ``div`` and ``seq_sum`` round as
the C code does, so the quantizers' bytes are llama.cpp's (that module's docstring says
how this is checked). Pure functions over float32 tensors on any device; nothing is kept.
"""

from __future__ import annotations

import struct
from typing import Tuple

import torch

Tensor = torch.Tensor

GROUP_MAX_EPS = 1e-15
"""llama.cpp's threshold under which a group counts as all zeros."""


def f32(v: float) -> float:
    """``v`` rounded to float32, so scalar constants carry the C code's float arithmetic."""
    return struct.unpack("f", struct.pack("f", v))[0]


def rdiv(c: float, t: Tensor) -> Tensor:
    """``c / t`` rounded once, as C divides: torch evaluates ``number / tensor`` as
    ``reciprocal(t) * c``, whose second rounding can move a level that sits on a tie."""
    return torch.full_like(t, c) / t


def div(t: Tensor, c: float) -> Tensor:
    """``t / c`` rounded once, as C divides: on CUDA torch divides by a Python number as a
    multiplication by its reciprocal (two roundings), but not by a device tensor."""
    return t / torch.full((), c, dtype=t.dtype, device=t.device)


# ---------------------------------------------------------------- scale searches
#
# The searches work element-major, ``[n, M]`` (n values of each of M groups), so that a
# group's sums run left to right one element at a time, as the C loops add them: float32
# sums in another order differ in the last bits, and those bits decide near-ties.


def seq_sum(terms: Tensor) -> Tensor:
    """``[n, ...] -> [...]``: the sum over dim 0 in index order."""
    acc = terms[0]
    for i in range(1, terms.shape[0]):
        acc = acc + terms[i]
    return acc


def _signed_absmax_t(xt: Tensor) -> Tensor:
    """``[n, M]`` -> the first element of largest magnitude per group, sign kept ``[M]``."""
    return xt.gather(0, xt.abs().argmax(dim=0, keepdim=True)).squeeze(0)


def make_qkx2(xt: Tensor, wt: Tensor, nmax: int, rmin: float, rdelta: float, nstep: int,
               use_mad: bool) -> Tuple[Tensor, Tensor, Tensor]:
    """llama.cpp's make_qkx2_quants over groups ``xt [n, M]`` with weights ``wt [n, M]``:
    levels 0..nmax with ``x ~ scale * L - min``. Tries the plain min/max fit, then
    ``nstep + 1`` stretched scales, each refitted by weighted least squares, keeping the
    lowest weighted error (abs with ``use_mad``, squared otherwise). As in the C code, the
    offset of the best fit so far is the origin of the next candidates.
    Returns (levels [n, M] float, scale [M], min [M] >= 0 as subtracted)."""
    lo = xt.amin(0).clamp(max=0.0)  # [M]: the min is never above 0
    hi = xt.amax(0)
    flat = hi == lo  # constant groups: scale 0 (their levels are 0)
    sum_w, sum_x = seq_sum(torch.stack([wt, wt * xt], dim=1)).unbind(0)  # [M] each

    def error(scale: Tensor, levels: Tensor, offset: Tensor) -> Tensor:
        diff = scale * levels + offset - xt
        return seq_sum(wt * (diff.abs() if use_mad else diff * diff))

    iscale = rdiv(nmax, hi - lo)
    scale = rdiv(1.0, iscale)
    levels = torch.round(iscale * (xt - lo)).clamp(0, nmax)
    best = error(scale, levels, lo)
    for step in range(nstep + 1):
        stretch = f32(f32(rmin + f32(f32(rdelta) * step)) + nmax)
        aux = torch.round(rdiv(stretch, hi - lo) * (xt - lo)).clamp(0, nmax)  # [n, M]
        wl = wt * aux
        sum_l, sum_l2, sum_xl = seq_sum(torch.stack([wl, wl * aux, wl * xt], dim=1)).unbind(0)
        det = sum_w * sum_l2 - sum_l * sum_l
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / det
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det
        positive = this_min > 0  # an offset above 0 is dropped and the scale refitted alone
        this_scale = torch.where(positive, sum_xl / sum_l2, this_scale)
        this_min = torch.where(positive, torch.zeros_like(this_min), this_min)
        cur = error(this_scale, aux, this_min)
        better = (det > 0) & (cur < best)  # NaN never wins
        levels = torch.where(better, aux, levels)
        best = torch.where(better, cur, best)
        scale = torch.where(better, this_scale, scale)
        lo = torch.where(better, this_min, lo)
    levels = torch.where(flat, torch.zeros_like(levels), levels)
    return levels, torch.where(flat, torch.zeros_like(scale), scale), -lo


def make_qx(xt: Tensor, nmax: int) -> Tuple[Tensor, Tensor]:
    """llama.cpp's make_qx_quants (rmse_type 1: weights x^2) over groups ``xt [n, M]``:
    symmetric levels -nmax..nmax-1 stored +nmax; of the scales ``(nmax + 0.1 i) / max``,
    i in -9..9, keeps the least-squares fit with the lowest weighted error.
    Returns (levels [n, M] float, scale [M]); groups of zeros give zeros."""
    mx = _signed_absmax_t(xt)  # [M]
    live = mx.abs() >= f32(GROUP_MAX_EPS)
    w = xt * xt
    wx = w * xt

    def fit(numer: float) -> Tuple[Tensor, Tensor, Tensor]:
        levels = torch.round(rdiv(numer, mx) * xt).clamp(-nmax, nmax - 1)  # [n, M]
        sums = seq_sum(torch.stack([wx * levels, w * levels * levels], dim=1))
        return (levels, *sums.unbind(0))

    levels, sumlx, suml2 = fit(-float(nmax))
    scale = torch.where(suml2 != 0, sumlx / suml2, torch.zeros_like(sumlx))
    best = scale * sumlx
    for i in [i for i in range(-9, 10) if i]:
        cand, slx, sl2 = fit(-f32(nmax + f32(f32(0.1) * i)))
        better = (sl2 > 0) & (slx * slx > best * sl2)
        levels = torch.where(better, cand, levels)
        scale = torch.where(better, slx / sl2, scale)
        best = torch.where(better, scale * slx, best)
    levels = torch.where(live, levels + nmax, torch.zeros_like(levels))
    return levels, torch.where(live, scale, torch.zeros_like(scale))


def make_q3(xt: Tensor, nmax: int, rounds: int = 5) -> Tuple[Tensor, Tensor]:
    """llama.cpp's make_q3_quants (with its rmse search) over groups ``xt [n, M]``:
    symmetric levels from ``-nmax / max``, then up to ``rounds`` passes of coordinate
    descent that move one level at a time to its least-squares value when that lowers the
    weighted (x^2) error; element by element, as in the C loop, all groups at once.
    Returns (levels +nmax [n, M] float, scale [M]); groups of zeros give zeros."""
    mx = _signed_absmax_t(xt)  # [M]
    live = mx.abs() >= f32(GROUP_MAX_EPS)
    iscale = torch.where(live, rdiv(-nmax, mx), torch.zeros_like(mx))
    w2t = xt * xt
    wxt = w2t * xt
    lt = torch.round(iscale * xt).clamp(-nmax, nmax - 1)  # [n, M]
    sumlx, suml2 = seq_sum(torch.stack([wxt * lt, w2t * lt * lt], dim=1)).unbind(0)  # [M]
    for _ in range(rounds):
        changed = torch.zeros_like(live)
        for i in range(xt.shape[0]):
            li = lt[i]
            slx = sumlx - wxt[i] * li
            sl2 = suml2 - w2t[i] * li * li
            new = torch.round(xt[i] * sl2 / slx).clamp(-nmax, nmax - 1)
            slx_new = slx + wxt[i] * new
            sl2_new = sl2 + w2t[i] * new * new
            take = ((slx > 0) & (new != li) & (sl2_new > 0)
                    & (slx_new * slx_new * suml2 > sumlx * sumlx * sl2_new))
            lt[i] = torch.where(take, new, li)
            sumlx = torch.where(take, slx_new, sumlx)
            suml2 = torch.where(take, sl2_new, suml2)
            changed |= take
        if not bool(changed.any()):  # a pass that moved nothing would move nothing again
            break
    levels = torch.where(live, lt + nmax, torch.zeros_like(lt))
    scale = torch.where(live & (suml2 > 0), sumlx / suml2, torch.zeros_like(sumlx))
    return levels, scale

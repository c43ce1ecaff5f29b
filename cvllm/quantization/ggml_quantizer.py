"""Float -> GGUF block quantizers, for in-situ quantization (``--isq``) and the GGUF writer.

Called by the ISQ path at load (each rank quantizes its own shard of a float weight on its
own device) and by ``tools/write_gguf.py`` (through ``tools/gguf_export``). Owns nothing:
``quantize`` is a pure function; its result lives on the input's device and belongs to
the caller. The byte layout is GGUF's (ggml-common.h), so the output can be written to a
GGUF file or handed to cvllm's GGUF kernels as it is.

The algorithms are llama.cpp's reference quantizers (``quantize_row_*_ref``, what
llama-quantize runs without an importance matrix), vectorized over blocks, in float32:

- Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0: one scale (and min) per 32 from the block's extremes.
- Q2_K / Q4_K / Q5_K: per sub-block scale and min from a grid search that minimizes the
  weighted error (make_qkx2_quants), the sub-block scales and mins then quantized against
  two fp16 super-block factors (6 bits, packed, for Q4_K / Q5_K; 4 bits for Q2_K), and the
  values re-rounded against the scales as stored.
- Q3_K: symmetric per-16 scale refined by coordinate descent on the levels (make_q3_quants).
- Q6_K: symmetric per-16 scale from 19 candidate scales (make_qx_quants).

The searches and the C code's float32 rounding live in ``quantization/ggml_search.py``;
this module packs their scales and levels into each type's bytes.

The output is meant to be byte-identical to llama.cpp's: the float32 operations are the C
code's, in its order (sums left to right, one rounding per operation, first-occurrence
extremes). Checked against llama.cpp's own functions on Gaussian, uniform, heavy-tailed,
sparse, integer, tiny and large weights. gguf-py's numpy quantizers give the same bytes for
the five plain types, except that they can write a zero scale or min as -0 where C writes
+0. One departure from both: fp16 factors saturate at +-65504 instead of becoming inf, so a
weight too large for the format gives a large finite error, never inf / NaN.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Dict, Iterator, Tuple

import torch

from cvllm.kernels.quant.ggml_types import BLOCK_SHAPES, GgmlType
from cvllm.quantization.ggml_search import (
    GROUP_MAX_EPS, div, f32, make_q3, make_qkx2, make_qx, rdiv, seq_sum,
)

Tensor = torch.Tensor

CHUNK_ELEMS = {"cpu": 1 << 16, "cuda": 1 << 24}
"""Elements quantized at a time, per device type: bounds the float32 temporaries of the
K-quant searches whatever the weight's size. Small on the CPU, where chunks that stay in
cache run about 3x faster than 8M-element ones; large on the GPU, where each chunk costs a
few thousand kernel launches (H100, 14336 x 4096: Q4_K 0.14 s with 0.7 GiB of temporaries
at 16M elements, 0.57 s at 4M)."""

_F16_MAX = 65504.0


def quantize(w: Tensor, t: GgmlType) -> Tensor:
    """Quantize float ``w [..., K]`` to GGUF blocks ``uint8 [..., K // B * S]`` of type ``t``
    (B elements in S bytes per block), on ``w``'s device. ValueError when ``K`` is not a
    whole number of blocks or ``t`` has no quantizer (see ``QUANTIZER_TYPES``)."""
    t = GgmlType(t)
    if t not in _QUANTIZERS:
        names = ", ".join(x.name for x in QUANTIZER_TYPES)
        raise ValueError(f"no quantizer for GGML type {t.name}; choose one of {names}")
    if w.dim() < 1 or not w.is_floating_point():
        raise ValueError(f"quantize takes a float tensor [..., K], got {w.dtype} {tuple(w.shape)}")
    elems, nbytes = BLOCK_SHAPES[t]
    k = w.shape[-1]
    if k % elems:
        raise ValueError(f"{t.name} quantizes rows in blocks of {elems} elements: a row of {k} "
                         f"is {k // elems} blocks and {k % elems} elements over")
    with torch.no_grad(), _one_cpu_thread(w.device):
        blocks = w.detach().reshape(-1, elems)  # [nb, B]
        out = torch.empty(blocks.shape[0], nbytes, dtype=torch.uint8, device=w.device)  # [nb, S]
        step = max(1, CHUNK_ELEMS.get(w.device.type, CHUNK_ELEMS["cuda"]) // elems)
        for start in range(0, blocks.shape[0], step):
            chunk = blocks[start:start + step].to(torch.float32)
            out[start:start + step] = _QUANTIZERS[t](chunk)
    return out.view(*w.shape[:-1], k // elems * nbytes)


# ---------------------------------------------------------------------------- helpers


@contextlib.contextmanager
def _one_cpu_thread(device: torch.device) -> Iterator[None]:
    """Run the CPU path on the calling thread alone. It is thousands of small ops per
    chunk; handing each to the intra-op pool costs more than it saves, and ruinously when
    the cores are busy (measured on 2 cores under load: Q4_K 0.4 s with one thread, 10-35 s
    with two)."""
    if device.type != "cpu":
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _f16(v: Tensor) -> Tensor:
    """float32 -> fp16, round to nearest even as GGML_FP32_TO_FP16, saturating (see top)."""
    return v.clamp(-_F16_MAX, _F16_MAX).to(torch.float16)


def _f16_bytes(v: Tensor) -> Tensor:
    """``[nb, 1]`` fp16 (or float32) -> its little-endian bytes ``uint8 [nb, 2]``."""
    half = v if v.dtype == torch.float16 else _f16(v)
    return half.contiguous().view(torch.uint8)


def _or_fields(fields: Tensor, bits: int, dim: int) -> Tensor:
    """Pack small non-negative integers along ``dim`` into one byte each: field ``k`` lands
    at bit ``bits * k``. The fields do not overlap, so the sum is their OR."""
    n = fields.shape[dim]
    shape = [1] * fields.dim()
    shape[dim] = n
    # arange, not a tensor from a list: no host-to-device copy inside the GPU loop
    shifts = torch.arange(0, bits * n, bits, dtype=torch.int32, device=fields.device)
    return (fields.to(torch.int32) << shifts.view(shape)).sum(dim).to(torch.uint8)


def _signed_absmax(x: Tensor) -> Tensor:
    """``x [M, n]`` -> the first element of largest magnitude per row, sign kept ``[M, 1]``;
    +0 for a row of zeros, as the C loop that only replaces on a strictly larger one."""
    mx = x.gather(1, x.abs().argmax(dim=1, keepdim=True))
    return torch.where(mx != 0, mx, torch.zeros_like(mx))


def _first_extremes(x: Tensor) -> Tuple[Tensor, Tensor]:
    """``x [M, n]`` -> (min, max) ``[M, 1]`` each, the first occurrence like the C loops,
    so that which of +0 / -0 is the extreme (and so the fp16 bits) is the C code's."""
    lo, hi = x.amin(1, keepdim=True), x.amax(1, keepdim=True)
    first_lo = (x == lo).to(torch.uint8).argmax(dim=1, keepdim=True)
    first_hi = (x == hi).to(torch.uint8).argmax(dim=1, keepdim=True)
    return x.gather(1, first_lo), x.gather(1, first_hi)


def _safe_recip(d: Tensor) -> Tensor:
    """``1 / d``, 0 where ``d`` is 0 (an all-zero block quantizes to zeros)."""
    return torch.where(d == 0, torch.zeros_like(d), rdiv(1.0, d))


# ------------------------------------------------------------------------ plain types


def _q4_0(x: Tensor) -> Tensor:
    d = div(_signed_absmax(x), -8)  # [nb, 1]; the extreme maps to level 0 exactly
    q = (x * _safe_recip(d) + 8.5).trunc().clamp(0, 15)  # [nb, 32]
    return torch.cat([_f16_bytes(d), _or_fields(q.view(-1, 2, 16), 4, 1)], dim=1)


def _q4_1(x: Tensor) -> Tensor:
    lo, hi = _first_extremes(x)  # [nb, 1]
    d = div(hi - lo, 15)
    q = ((x - lo) * _safe_recip(d) + 0.5).trunc().clamp(0, 15)  # [nb, 32]
    return torch.cat([_f16_bytes(d), _f16_bytes(lo), _or_fields(q.view(-1, 2, 16), 4, 1)], dim=1)


def _q5_split(q: Tensor) -> Tuple[Tensor, Tensor]:
    """5-bit levels ``[nb, 32]`` -> (qh: bit i of a little-endian uint32 is level i's 5th bit
    ``[nb, 4]``, qs: low nibbles, element j with j + 16 ``[nb, 16]``)."""
    qi = q.to(torch.int32)
    qh = _or_fields((qi >> 4).view(-1, 4, 8), 1, 2)
    qs = _or_fields((qi & 0xF).view(-1, 2, 16), 4, 1)
    return qh, qs


def _q5_0(x: Tensor) -> Tensor:
    d = div(_signed_absmax(x), -16)  # [nb, 1]
    q = (x * _safe_recip(d) + 16.5).trunc().clamp(0, 31)  # [nb, 32]
    qh, qs = _q5_split(q)
    return torch.cat([_f16_bytes(d), qh, qs], dim=1)


def _q5_1(x: Tensor) -> Tensor:
    lo, hi = _first_extremes(x)  # [nb, 1]
    d = div(hi - lo, 31)
    q = ((x - lo) * _safe_recip(d) + 0.5).trunc().clamp(0, 31)  # [nb, 32]
    qh, qs = _q5_split(q)
    return torch.cat([_f16_bytes(d), _f16_bytes(lo), qh, qs], dim=1)


def _round_half_away(v: Tensor) -> Tensor:
    """C's roundf. ``floor(|v| + 0.5)`` would round 0.49999997 up (the sum rounds to 1.0);
    the fraction test is exact."""
    a = v.abs()
    whole = a.floor()
    return torch.sign(v) * (whole + (2 * (a - whole)).floor())


def _q8_0(x: Tensor) -> Tensor:
    d = div(x.abs().amax(1, keepdim=True), 127)  # [nb, 1]
    q = _round_half_away(x * _safe_recip(d)).to(torch.int8)  # [nb, 32]
    return torch.cat([_f16_bytes(d), q.view(torch.uint8)], dim=1)


# --------------------------------------------------------------------------- K-quants


def _positive_max(v: Tensor) -> Tensor:
    """``[nb, G] -> [nb, 1]``: the largest value, or +0 when none is above 0 (the C loop
    starts from 0; a -0 from an all-zero group would write the fp16 factor as 0x8000)."""
    top = v.amax(1, keepdim=True)
    return torch.where(top > 0, top, torch.zeros_like(top))


def _element_major(x: Tensor, n: int) -> Tensor:
    """Super-blocks ``[nb, 256]`` -> groups of ``n`` element-major ``[n, nb * 256 / n]``."""
    return x.reshape(-1, n).t().contiguous()


def _group_major(levels: Tensor, nb: int) -> Tensor:
    """Inverse of ``_element_major``: ``[n, M]`` -> ``[nb, groups per block, n]``."""
    return levels.t().reshape(nb, -1, levels.shape[0])


def _q2_k(x: Tensor) -> Tensor:
    nb = x.shape[0]
    xt = _element_major(x, 16)  # [16, nb*16]
    levels, scales, mins = make_qkx2(xt, xt.abs(), 3, -0.5, 0.1, 15, True)
    scales, mins = scales.view(nb, 16), mins.view(nb, 16)
    max_scale, max_min = _positive_max(scales), _positive_max(mins)  # [nb, 1]
    zero = torch.zeros_like(max_scale)
    ls = torch.round(torch.where(max_scale > 0, rdiv(15, max_scale), zero) * scales)
    lm = torch.round(torch.where(max_min > 0, rdiv(15, max_min), zero) * mins)
    # Stored as in C: a uint8 of the low scale bits OR the min shifted by 4 (wrapping).
    sc = (ls.to(torch.int32) & 0xFF) | ((lm.to(torch.int32) << 4) & 0xFF)  # [nb, 16]
    d16, dmin16 = _f16(div(max_scale, 15)), _f16(div(max_min, 15))
    d = d16.float() * (sc & 0xF)  # [nb, 16]
    dm = dmin16.float() * (sc >> 4)
    subs = x.view(nb, 16, 16)
    requant = torch.round((subs + dm.unsqueeze(2)) / d.unsqueeze(2)).clamp(0, 3)
    levels = torch.where(d.unsqueeze(2) != 0, requant, _group_major(levels, nb))
    qs = _or_fields(levels.view(nb, 2, 4, 32), 2, 2).view(nb, 64)
    return torch.cat([sc.to(torch.uint8), qs, _f16_bytes(d16), _f16_bytes(dmin16)], dim=1)


def _q3_k(x: Tensor) -> Tensor:
    nb = x.shape[0]
    levels, scales = make_q3(_element_major(x, 16), 4)
    scales = scales.view(nb, 16)  # [nb, 16]
    max_scale = _signed_absmax(scales)  # [nb, 1]
    live = max_scale != 0
    iscale = torch.where(live, rdiv(-32, max_scale), torch.zeros_like(max_scale))
    ls = (torch.round(iscale * scales).clamp(-32, 31) + 32).to(torch.int32)  # [nb, 16] 0..63
    ls = torch.where(live, ls, torch.zeros_like(ls))
    d16 = _f16(torch.where(live, rdiv(1.0, iscale), torch.zeros_like(iscale)))
    d = d16.float() * (ls - 32)  # [nb, 16]
    subs = x.view(nb, 16, 16)
    requant = torch.round(subs / d.unsqueeze(2)).clamp(-4, 3) + 4
    levels = torch.where(d.unsqueeze(2) != 0, requant, _group_major(levels, nb)).view(nb, 256)
    high = levels > 3  # the 3rd bit goes to hmask: byte m, bit k <- element 32 k + m
    levels = torch.where(high, levels - 4, levels)
    hmask = _or_fields(high.view(nb, 8, 32), 1, 1)  # [nb, 32]
    qs = _or_fields(levels.view(nb, 2, 4, 32), 2, 2).view(nb, 64)
    low = (ls[:, :8] & 0xF) | ((ls[:, 8:] & 0xF) << 4)  # [nb, 8]: scale j low, j + 8 high
    top = _or_fields((ls >> 4).view(nb, 4, 4), 2, 1)  # [nb, 4]: byte j % 4, bits 2 (j // 4)
    return torch.cat([hmask, qs, low.to(torch.uint8), top, _f16_bytes(d16)], dim=1)


def _six_bit(values: Tensor, vmax: Tensor) -> Tensor:
    """Sub-block scales or mins ``[nb, 8]`` as 0..63 against ``vmax [nb, 1]``; like the
    C code's uint8 store, a negative rounds through 255 to 63."""
    inv = torch.where(vmax > 0, rdiv(63, vmax), torch.zeros_like(vmax))
    return (torch.round(inv * values).to(torch.int32) & 0xFF).clamp(max=63)


def _qkx_k(x: Tensor, nmax: int, rmin: float, nstep: int) -> Tuple[Tensor, Tensor]:
    """Q4_K / Q5_K body: 8 sub-blocks of 32 with scale and min each.
    Returns (d, dmin and the 12 packed scale bytes ``uint8 [nb, 16]``,
    levels ``int32 [nb, 256]``)."""
    nb = x.shape[0]
    xt = _element_major(x, 32)  # [32, nb*8]
    # sqrtf is correctly rounded; torch's float32 sqrt on the CPU (Sleef, 0.5001 ulp) is
    # not always, and one ulp here moves the weights. float64 then float32 is exact.
    av_x = torch.sqrt(div(seq_sum(xt * xt), 32).double()).float()  # [nb*8]
    levels, scales, mins = make_qkx2(xt, av_x + xt.abs(), nmax, rmin, 0.1, nstep, False)
    scales, mins = scales.view(nb, 8), mins.view(nb, 8)
    max_scale, max_min = _positive_max(scales), _positive_max(mins)  # [nb, 1]
    ls, lm = _six_bit(scales, max_scale), _six_bit(mins, max_min)  # [nb, 8]
    d16, dmin16 = _f16(div(max_scale, 63)), _f16(div(max_min, 63))
    d, dm = d16.float() * ls, dmin16.float() * lm  # [nb, 8]
    subs = x.view(nb, 8, 32)
    requant = torch.round((subs + dm.unsqueeze(2)) / d.unsqueeze(2)).clamp(0, nmax)
    levels = torch.where(d.unsqueeze(2) != 0, requant, _group_major(levels, nb))
    # 12 bytes: scales 0-3 and mins 0-3 in 6 bits, their top 2 bits holding the high bits
    # of scales / mins 4-7, whose low nibbles fill bytes 8-11.
    packed = torch.cat([ls[:, :4] | ((ls[:, 4:] >> 4) << 6), lm[:, :4] | ((lm[:, 4:] >> 4) << 6),
                        (ls[:, 4:] & 0xF) | ((lm[:, 4:] & 0xF) << 4)], dim=1)
    header = torch.cat([_f16_bytes(d16), _f16_bytes(dmin16), packed.to(torch.uint8)], dim=1)
    return header, levels.reshape(nb, 256).to(torch.int32)


def _q4_k(x: Tensor) -> Tensor:
    header, levels = _qkx_k(x, 15, -1.0, 20)
    qs = _or_fields(levels.view(-1, 4, 2, 32), 4, 2).view(-1, 128)  # 64 elements per 32 bytes
    return torch.cat([header, qs], dim=1)


def _q5_k(x: Tensor) -> Tensor:
    header, levels = _qkx_k(x, 31, -0.5, 15)
    qh = _or_fields((levels >> 4).view(-1, 8, 32), 1, 1)  # byte m, bit k <- element 32 k + m
    qs = _or_fields((levels & 0xF).view(-1, 4, 2, 32), 4, 2).view(-1, 128)
    return torch.cat([header, qh, qs], dim=1)


def _q6_k(x: Tensor) -> Tensor:
    nb = x.shape[0]
    levels, scales = make_qx(_element_major(x, 16), 32)
    scales = scales.view(nb, 16)  # [nb, 16]
    max_scale = _signed_absmax(scales)  # [nb, 1]
    live = max_scale.abs() >= f32(GROUP_MAX_EPS)
    iscale = torch.where(live, rdiv(-128, max_scale), torch.zeros_like(max_scale))
    d16 = _f16(torch.where(live, rdiv(1.0, iscale), torch.zeros_like(iscale)))
    sc = torch.round(iscale * scales).clamp(max=127)  # [nb, 16] int8 range
    d = d16.float() * sc
    requant = torch.round(x.view(nb, 16, 16) / d.unsqueeze(2)).clamp(-32, 31) + 32
    levels = torch.where(d.unsqueeze(2) != 0, requant, _group_major(levels, nb))
    lv = levels.view(nb, 2, 4, 32).to(torch.int32)  # halves of 128, quarters of 32
    # ql: per half, 64 bytes; byte 32 s + l holds quarter s (low) and s + 2 (high) nibbles.
    ql = _or_fields((lv & 0xF).view(nb, 2, 2, 2, 32), 4, 2).view(nb, 128)
    qh = _or_fields(lv >> 4, 2, 2).view(nb, 64)  # per half: quarter k's top 2 bits at 2 k
    out = torch.cat([ql, qh, sc.to(torch.int8).view(torch.uint8), _f16_bytes(d16)], dim=1)
    return torch.where(live, out, torch.zeros_like(out))  # a block of zeros is all zero bytes


_QUANTIZERS: Dict[GgmlType, Callable[[Tensor], Tensor]] = {
    GgmlType.Q4_0: _q4_0, GgmlType.Q4_1: _q4_1, GgmlType.Q5_0: _q5_0, GgmlType.Q5_1: _q5_1,
    GgmlType.Q8_0: _q8_0, GgmlType.Q2_K: _q2_k, GgmlType.Q3_K: _q3_k, GgmlType.Q4_K: _q4_k,
    GgmlType.Q5_K: _q5_k, GgmlType.Q6_K: _q6_k,
}
"""``type -> f(blocks float32 [nb, B]) -> uint8 [nb, S]``."""

QUANTIZER_TYPES = tuple(_QUANTIZERS)
"""The types ``quantize`` writes (every ``--isq`` type)."""

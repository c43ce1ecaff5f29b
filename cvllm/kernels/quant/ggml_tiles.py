"""Triton device functions that load and dequantize one tile of a split GGML weight.

Shared by every kernel of ``ggml_cuda.py`` (the batch GEMV, the tensor-core GEMM, the
dequantize / embedding kernel), so a type's decoding is written once. The layout they
read is ``ggml_pack.py``'s; its ``PackSpec`` fields arrive as ``tl.constexpr``
(``SB, LB, HB, SUPER, MODE, OFF, LUT, DD``). No host code here.

A tile is ``BN`` weight rows by ``NSUB`` scale sub-blocks of ``SB`` elements.
``load_tile`` fetches the raw fields (the loads of one K step, issued together so they
are in flight at once). ``field_values`` decodes field ``f`` of every word (``ggml_pack``
stores a sub-block field-major: field ``f`` of its ``WPS`` words is the run of elements
``f * WPS ..``), ``tile_scales`` the per-sub-block affine terms ``s, m``: an element is
``s * q + m`` (IQ4_*: ``s * kvalues[q]``). The GEMV multiplies each field by its run of
activations and scales once per sub-block (``s * sum(q x) + m * sum(x)``: one FMA an
element); ``tile_weights`` applies ``s, m`` per element and puts the fields back in
element order for ``tl.dot``.

Integer -> float without I2F (a quarter of the FP32 rate on Hopper: it would bound the
batch-1 GEMV under the memory roofline): a field at bits ``[P, P + W)`` of a word, masked
in place and OR-ed with the exponent of ``2**23``, reads as the float ``2**23 + q * 2**P``;
one LOP3 and one FADD give ``q * 2**P`` exactly, the power of two folded into the
activations (GEMV) or the scale (GEMM). The exponent comes in as a run-time argument
(``magic``): as a literal, ptxas makes it LOP3's immediate and re-creates the field's mask
before every LOP3 (a third instruction an element).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _ld(ptrs, mask, EVEN: tl.constexpr, EVICT_FIRST: tl.constexpr):
    """A weight-field load: unmasked when the tile is whole; streamed (evict first) when
    each byte is read by one program only."""
    if EVEN:
        if EVICT_FIRST:
            v = tl.load(ptrs, eviction_policy="evict_first")
        else:
            v = tl.load(ptrs)
    else:
        if EVICT_FIRST:
            v = tl.load(ptrs, mask=mask, other=0, eviction_policy="evict_first")
        else:
            v = tl.load(ptrs, mask=mask, other=0)
    return v


@triton.jit
def load_tile(lo_ptr, hi_ptr, d_ptr, dm_ptr, sc_ptr, rows, k0, K, s_lo, s_sub, s_d,
              SB: tl.constexpr, LB: tl.constexpr, HB: tl.constexpr, SUPER: tl.constexpr,
              MODE: tl.constexpr, NSUB: tl.constexpr, EVEN_K: tl.constexpr,
              EVICT_FIRST: tl.constexpr, DD: tl.constexpr, VEC: tl.constexpr = 0):
    """The raw fields of rows ``rows [BN]`` (in range), elements ``k0 .. k0 + NSUB*SB``:
    ``lo [BN, NSUB * WPS]`` int32 words (2-D: a row's words are one contiguous run, so
    every Triton version orders its layout the same way), ``hi [BN, NSUB]``, ``d, dm, sc,
    mn [BN, NSUB]`` (absent fields come back as ``lo``; they are not read). Sub-blocks
    past ``K`` read as zero."""
    WPS: tl.constexpr = SB * LB // 32
    sub = k0 // SB + tl.arange(0, NSUB)  # [NSUB] sub-block index along the row
    r64 = rows.to(tl.int64)
    kmask = (sub < K // SB)[None, :]  # [1, NSUB]
    j = k0 // SB * WPS + tl.arange(0, NSUB * WPS)  # [NSUB * WPS] word index along the row
    lo_offs = r64[:, None] * s_lo + j[None, :]
    if VEC > 0:  # VEC words a thread: the layout of the GEMV's activation loads
        lo_offs = tl.max_contiguous(lo_offs, [1, VEC])
    lo = _ld(lo_ptr + lo_offs, (j < K // SB * WPS)[None, :], EVEN_K, EVICT_FIRST)
    sub_offs = r64[:, None] * s_sub + sub[None, :]  # [BN, NSUB]
    hi = lo
    if HB > 0:
        hi = _ld(hi_ptr + sub_offs, kmask, EVEN_K, EVICT_FIRST)
    dm = lo
    if DD:  # one int32 (d, dm) a row and superblock: a 4-byte load a row, asynchronous
        d, dm = _load_dd(d_ptr, r64, k0, K, s_d, SB, SUPER, NSUB, EVEN_K)
    else:
        d_offs = r64[:, None] * s_d + (sub // (SUPER // SB))[None, :]  # [BN, NSUB]
        d = _ld(d_ptr + d_offs, kmask, EVEN_K, False)
        if MODE == 1:  # Q4_1, Q5_1 (the other types with a min are ``DD``)
            dm = _ld(dm_ptr + d_offs, kmask, EVEN_K, False)
    sc = lo
    if MODE >= 2:
        sc = _ld(sc_ptr + sub_offs, kmask, EVEN_K, EVICT_FIRST)
    mn = lo
    if MODE == 3:  # ``PackSpec.scm``: int16, the scale low byte, the min high
        sc, mn = unpack_scm(sc)
    return lo, hi, d, dm, sc, mn


@triton.jit
def unpack_dd(w):
    """``d, dm`` fp16 from the packed int32 of ``PackSpec.dd`` (``d`` low, ``dm`` high)."""
    d = (w & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)
    dm = (w >> 16).to(tl.int16).to(tl.float16, bitcast=True)
    return d, dm


@triton.jit
def unpack_scm(v):
    """``sc, mn`` int32 from the int16 of ``PackSpec.scm`` (scale low byte, min high)."""
    v = v.to(tl.int32)
    return v & 255, (v >> 8) & 255


@triton.jit
def _load_dd(d_ptr, r64, k0, K, s_d, SB: tl.constexpr, SUPER: tl.constexpr,
             NSUB: tl.constexpr, EVEN_K: tl.constexpr):
    """``d, dm [BN, NSUB]`` fp16 of the steps' sub-blocks from the packed int32 ``d``
    (``PackSpec.dd``): one word a row when the step lies in one superblock (``NSUB * SB <=
    SUPER``; steps are aligned to their size), else ``NSUB * SB / SUPER`` words."""
    bn: tl.constexpr = r64.shape[0]
    if NSUB * SB <= SUPER:
        w = tl.load(d_ptr + r64 * s_d + k0 // SUPER)  # [BN]: k0 < K, so in the row
        w = tl.broadcast_to(w[:, None], (bn, NSUB))
    else:
        NSUP: tl.constexpr = NSUB * SB // SUPER
        sup = k0 // SUPER + tl.arange(0, NSUP)
        w = _ld(d_ptr + r64[:, None] * s_d + sup[None, :], (sup < K // SUPER)[None, :],
                EVEN_K, False)  # [BN, NSUP]
        w = tl.reshape(tl.broadcast_to(w[:, :, None], (bn, NSUP, SUPER // SB)), (bn, NSUB))
    return unpack_dd(w)


@triton.jit
def _lowfield(bits, P: tl.constexpr, W: tl.constexpr, magic):
    """Bits ``[P, P + W)`` of int32 ``bits``, in place, as float32: ``field * 2**P``
    exactly (needs ``P + W <= 23``). One LOP3 (the mask an immediate, the exponent the
    same register for every field) and one FADD."""
    v = (bits & (((1 << W) - 1) << P)) | magic
    return v.to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _iq4_value(q):
    """``IQ4_KVALUES[q]`` for float ``q`` in 0..15, computed instead of gathered (a table
    load per element costs as much, and a gather in the GEMM trips Triton 3.6's
    dot-operand pass): the degree-4 minimax fit to the table is within 0.433 of every
    entry, so rounding it (to nearest, by the 1.5 * 2**23 trick) gives the entry."""
    p = 0.0015860428102314472 * q + 0.03108643926680088
    p = p * q - 1.37192702293396
    p = p * q + 24.173830032348633
    p = p * q - 126.56700897216797
    return (p + 12582912.0) - 12582912.0


@triton.jit
def field_shift(F: tl.constexpr, LB: tl.constexpr):
    """The power of two ``field_values`` leaves on field ``F``: its bit position in ``lo``,
    or in ``lo >> 16`` for fields that reach past the float mantissa."""
    P: tl.constexpr = F * LB
    if P + LB > 23:
        P = P - 16
    return P


@triton.jit
def field_values(lo, lo16, hiw, F: tl.constexpr, LB: tl.constexpr,
                 HB: tl.constexpr, LUT: tl.constexpr, magic=0x4B000000):
    """Field ``F`` of every word of ``lo`` (with its high bits from ``hiw``) as float32
    unsigned quants times ``2**field_shift(F, LB)`` (the caller scales x or s by the
    inverse, a power of two: exact); IQ4: the table's values, unscaled. ``lo16 = lo >> 16``
    serves the fields that reach past the mantissa."""
    P: tl.constexpr = F * LB
    if P + LB <= 23:
        q = _lowfield(lo, P, LB, magic)
        PE: tl.constexpr = P
    else:
        q = _lowfield(lo16, P - 16, LB, magic)
        PE: tl.constexpr = P - 16
    if HB > 0:  # + high bits * 2**LB, in the same units
        E: tl.constexpr = LB + PE - F * HB
        if E >= 0:
            q += _lowfield(hiw, F * HB, HB, magic) * (1 << E)
        else:
            q += _lowfield(hiw, F * HB, HB, magic) * (1.0 / (1 << -E))
    if LUT:
        q = _iq4_value(q * (1.0 / (1 << PE)))
    return q


@triton.jit
def tile_prep(lo, hi, LB: tl.constexpr, HB: tl.constexpr, SB: tl.constexpr):
    """``(lo16, hiw)`` for ``field_values``, shaped like ``lo`` (``[BN, NSUB * WPS]`` or
    ``[BN, NSUB, WPS]``): the words shifted down 16 bits, and each word's share of its
    sub-block's high bits (``lo`` where unused)."""
    EPW: tl.constexpr = 32 // LB
    WPS: tl.constexpr = SB // EPW
    lo16 = lo
    if EPW * LB > 23:
        lo16 = lo >> 16
    hiw = lo
    if HB > 0:
        wsh = tl.arange(0, WPS) * (HB * EPW)
        hiw = hi.to(tl.int32)[:, :, None] >> wsh[None, None, :]  # [BN, NSUB, WPS]
        hiw = tl.reshape(hiw, lo.shape)
    return lo16, hiw


@triton.jit
def tile_scales(d, dm, sc, mn, MODE: tl.constexpr, OFF: tl.constexpr):
    """``s, m [BN, NSUB]`` float32: the sub-blocks' ``value = s * q + m``."""
    df = d.to(tl.float32)
    if MODE == 0:
        s = df
        m = df * OFF
    elif MODE == 1:
        s = df
        m = dm.to(tl.float32)
    elif MODE == 2:
        s = df * sc.to(tl.float32)
        m = s * OFF
    elif MODE == 3:
        s = df * sc.to(tl.float32)
        m = -(dm.to(tl.float32) * mn.to(tl.float32))
    else:
        sci = sc.to(tl.int32)
        s = df * (sci & 15).to(tl.float32)
        m = -(dm.to(tl.float32) * (sci >> 4).to(tl.float32))
    return s, m


@triton.jit
def _il4(a0, a1, a2, a3):
    """Four ``[.., W]`` tensors -> ``[.., 4W]`` with ``out[4w + f] = a_f[w]``."""
    return tl.interleave(tl.interleave(a0, a2), tl.interleave(a1, a3))


@triton.jit
def _il8(a0, a1, a2, a3, a4, a5, a6, a7):
    """Eight ``[.., W]`` tensors -> ``[.., 8W]`` with ``out[8w + f] = a_f[w]``."""
    return tl.interleave(_il4(a0, a2, a4, a6), _il4(a1, a3, a5, a7))


@triton.jit
def _wf(lo, lo16, hiw, s, m, F: tl.constexpr, LB: tl.constexpr, HB: tl.constexpr,
        LUT: tl.constexpr, OUT_DTYPE: tl.constexpr, magic):
    """Dequantized field ``F`` ``[BN, NSUB, WPS]`` in ``OUT_DTYPE``."""
    q = field_values(lo, lo16, hiw, F, LB, HB, LUT, magic)
    if not LUT:
        s = s * (1.0 / (1 << field_shift(F, LB)))
    return (q * s[:, :, None] + m[:, :, None]).to(OUT_DTYPE)


@triton.jit
def tile_weights(lo, hi, d, dm, sc, mn, SB: tl.constexpr, LB: tl.constexpr,
                 HB: tl.constexpr, MODE: tl.constexpr, OFF: tl.constexpr, LUT: tl.constexpr,
                 NSUB: tl.constexpr, OUT_DTYPE: tl.constexpr, magic=0x4B000000):
    """The dequantized tile ``[BN, NSUB * SB]`` in element order, in ``OUT_DTYPE``
    (float32 arithmetic, one rounding). The fields are interleaved (``[.., WPS, EPW]``)
    and the two last axes swapped back to element order (``f * WPS + w``)."""
    EPW: tl.constexpr = 32 // LB
    WPS: tl.constexpr = SB // EPW
    lo = tl.reshape(lo, (lo.shape[0], NSUB, WPS))
    lo16, hiw = tile_prep(lo, hi, LB, HB, SB)
    s, m = tile_scales(d, dm, sc, mn, MODE, OFF)
    if EPW == 4:
        w = _il4(_wf(lo, lo16, hiw, s, m, 0, LB, HB, LUT, OUT_DTYPE, magic),
                 _wf(lo, lo16, hiw, s, m, 1, LB, HB, LUT, OUT_DTYPE, magic),
                 _wf(lo, lo16, hiw, s, m, 2, LB, HB, LUT, OUT_DTYPE, magic),
                 _wf(lo, lo16, hiw, s, m, 3, LB, HB, LUT, OUT_DTYPE, magic))
    elif EPW == 8:
        w = _il8(_wf(lo, lo16, hiw, s, m, 0, LB, HB, LUT, OUT_DTYPE, magic),
                 _wf(lo, lo16, hiw, s, m, 1, LB, HB, LUT, OUT_DTYPE, magic),
                 _wf(lo, lo16, hiw, s, m, 2, LB, HB, LUT, OUT_DTYPE, magic),
                 _wf(lo, lo16, hiw, s, m, 3, LB, HB, LUT, OUT_DTYPE, magic),
                 _wf(lo, lo16, hiw, s, m, 4, LB, HB, LUT, OUT_DTYPE, magic),
                 _wf(lo, lo16, hiw, s, m, 5, LB, HB, LUT, OUT_DTYPE, magic),
                 _wf(lo, lo16, hiw, s, m, 6, LB, HB, LUT, OUT_DTYPE, magic),
                 _wf(lo, lo16, hiw, s, m, 7, LB, HB, LUT, OUT_DTYPE, magic))
    else:
        w = tl.interleave(
            _il8(_wf(lo, lo16, hiw, s, m, 0, LB, HB, LUT, OUT_DTYPE, magic),
                 _wf(lo, lo16, hiw, s, m, 2, LB, HB, LUT, OUT_DTYPE, magic),
                 _wf(lo, lo16, hiw, s, m, 4, LB, HB, LUT, OUT_DTYPE, magic),
                 _wf(lo, lo16, hiw, s, m, 6, LB, HB, LUT, OUT_DTYPE, magic),
                 _wf(lo, lo16, hiw, s, m, 8, LB, HB, LUT, OUT_DTYPE, magic),
                 _wf(lo, lo16, hiw, s, m, 10, LB, HB, LUT, OUT_DTYPE, magic),
                 _wf(lo, lo16, hiw, s, m, 12, LB, HB, LUT, OUT_DTYPE, magic),
                 _wf(lo, lo16, hiw, s, m, 14, LB, HB, LUT, OUT_DTYPE, magic)),
            _il8(_wf(lo, lo16, hiw, s, m, 1, LB, HB, LUT, OUT_DTYPE, magic),
                 _wf(lo, lo16, hiw, s, m, 3, LB, HB, LUT, OUT_DTYPE, magic),
                 _wf(lo, lo16, hiw, s, m, 5, LB, HB, LUT, OUT_DTYPE, magic),
                 _wf(lo, lo16, hiw, s, m, 7, LB, HB, LUT, OUT_DTYPE, magic),
                 _wf(lo, lo16, hiw, s, m, 9, LB, HB, LUT, OUT_DTYPE, magic),
                 _wf(lo, lo16, hiw, s, m, 11, LB, HB, LUT, OUT_DTYPE, magic),
                 _wf(lo, lo16, hiw, s, m, 13, LB, HB, LUT, OUT_DTYPE, magic),
                 _wf(lo, lo16, hiw, s, m, 15, LB, HB, LUT, OUT_DTYPE, magic)))
    bn: tl.constexpr = w.shape[0]
    if WPS > 1:  # [BN, NSUB, WPS * EPW] (w, f) -> (f, w): element order
        w = tl.permute(tl.reshape(w, (bn, NSUB, WPS, EPW)), (0, 1, 3, 2))
    return tl.reshape(w, (bn, NSUB * SB))

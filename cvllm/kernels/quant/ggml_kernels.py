"""The Triton kernels over split GGML weights: batch GEMV, tensor-core GEMM, dequantize.

Launched only by ``ggml_cuda.py`` (which checks every input first and plans the tiles);
the tile decoding they share is ``ggml_tiles.py``. Weight fields are the layout of
``ggml_pack.py``; ``x`` rows are contiguous, ``y`` rows too. No state.

- ``ggml_gemv_kernel``: ``BM`` (1..16) input rows against ``BN`` weight rows a program,
  float32 FMA in registers: each program streams its rows' blocks once, sums ``q * x``
  over each scale sub-block, then scales once per sub-block. One stage of register
  prefetch (``PREFETCH``: the next K step's fields are loaded before this one is
  reduced) and programmatic dependent launch (``PDL``: the first tile is in flight
  before the kernel that wrote ``x`` has finished, as in ``kernels/gemv.py``).
- ``ggml_gemv_i8_kernel``: one input row of the plain 4-bit types (Q4_0, Q4_1, Q4_K) and
  Q8_0, the activations rounded to int8 per sub-block and summed with ``dp4a`` (the
  batch-1 decode path: the float GEMV is bound by its instruction issue on these types).
- ``ggml_gemv_i8_q6_kernel``: the same for Q6_K (16-element sub-blocks, two high bits an
  element spread into each byte before its ``dp4a``), x rounded per 16 elements.
- ``ggml_mm_kernel``: a ``[BM, BN]`` output tile a program; each weight tile is decoded
  in registers to x's dtype and fed to ``tl.dot`` (tensor cores), float32 accumulator.
- ``ggml_dequant_kernel``: rows of the weight (all, or those named by token ids) into a
  dense ``[R, K]`` tensor; the large-M path (then cuBLAS) and the embedding.
"""

from __future__ import annotations

import triton
import triton.language as tl

from cvllm.kernels.gemv import load_act_x
from cvllm.kernels.pdl import gdc_enter, gdc_launch_dependents, gdc_wait
from cvllm.kernels.quant.ggml_tiles import (field_shift, field_values, load_tile, tile_prep,
                                            tile_scales, tile_weights, unpack_dd, unpack_scm)


@triton.jit
def _gemv_step(lo, hi, d, dm, sc, mn, x_ptr, stride_xm, M, k0, K, magic,
               SB: tl.constexpr, LB: tl.constexpr, HB: tl.constexpr, MODE: tl.constexpr,
               OFF: tl.constexpr, LUT: tl.constexpr, BM: tl.constexpr, NSUB: tl.constexpr,
               EVEN_K: tl.constexpr):
    """One K step of the GEMV: partial sums ``[BM, BN, NSUB]`` (``[BN, NSUB]`` when
    ``BM == 1``), already scaled. Field ``f`` of the words pairs with the run of
    ``WPS`` activations at ``f * WPS`` of each sub-block (``ggml_pack``'s word order), a
    load in the words' own layout; ``sum(q * x)`` and ``sum(x)`` are taken per word and
    scaled once: ``s * sum(q x) + m * sum(x)``."""
    EPW: tl.constexpr = 32 // LB
    WPS: tl.constexpr = SB // EPW
    BN: tl.constexpr = lo.shape[0]
    lo16, hiw = tile_prep(lo, hi, LB, HB, SB)  # [BN, NSUB * WPS]
    s, m = tile_scales(d, dm, sc, mn, MODE, OFF)  # [BN, NSUB]
    j = tl.arange(0, NSUB * WPS)
    xoff = k0 + (j // WPS) * SB + j % WPS  # [NSUB * WPS]: field 0 of each word
    kmask = (xoff < K)[None, :]
    if BM == 1:
        xo = x_ptr + xoff[None, :]  # [1, NSUB * WPS]
        p = tl.zeros((BN, NSUB * WPS), dtype=tl.float32)
        xs = tl.zeros((1, NSUB * WPS), dtype=tl.float32)
        for f in tl.static_range(EPW):
            if EVEN_K:
                x = tl.load(xo + f * WPS, eviction_policy="evict_last")
            else:
                x = tl.load(xo + f * WPS, mask=kmask, other=0.0, eviction_policy="evict_last")
            x = x.to(tl.float32)
            xs += x
            if not LUT:
                x = x * (1.0 / (1 << field_shift(f, LB)))
            p += field_values(lo, lo16, hiw, f, LB, HB, LUT, magic) * x
        p = tl.sum(tl.reshape(p, (BN, NSUB, WPS)), axis=2)  # [BN, NSUB]
        xs = tl.sum(tl.reshape(xs, (1, NSUB, WPS)), axis=2)  # [1, NSUB]
        out = p * s + xs * m
    else:
        offs_m = tl.arange(0, BM)
        xo = x_ptr + offs_m[:, None] * stride_xm + xoff[None, :]  # [BM, NSUB * WPS]
        mask = (offs_m < M)[:, None] & kmask
        p = tl.zeros((BM, BN, NSUB * WPS), dtype=tl.float32)
        xs = tl.zeros((BM, NSUB * WPS), dtype=tl.float32)
        for f in tl.static_range(EPW):
            x = tl.load(xo + f * WPS, mask=mask, other=0.0, eviction_policy="evict_last")
            x = x.to(tl.float32)
            xs += x
            if not LUT:
                x = x * (1.0 / (1 << field_shift(f, LB)))
            q = field_values(lo, lo16, hiw, f, LB, HB, LUT, magic)
            p += q[None, :, :] * x[:, None, :]
        p = tl.sum(tl.reshape(p, (BM, BN, NSUB, WPS)), axis=3)  # [BM, BN, NSUB]
        xs = tl.sum(tl.reshape(xs, (BM, 1, NSUB, WPS)), axis=3)  # [BM, 1, NSUB]
        out = p * s[None, :, :] + xs * m[None, :, :]
    return out


@triton.jit
def ggml_gemv_kernel(
    x_ptr, y_ptr, b_ptr, lo_ptr, hi_ptr, d_ptr, dm_ptr, sc_ptr, ids_ptr,
    M, N, K, stride_xm, stride_ym, s_lo, s_sub, s_d, magic,
    SB: tl.constexpr, LB: tl.constexpr, HB: tl.constexpr, SUPER: tl.constexpr,
    MODE: tl.constexpr, OFF: tl.constexpr, LUT: tl.constexpr, DD: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, NSUB: tl.constexpr, HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr, PREFETCH: tl.constexpr, PDL: tl.constexpr, WARPS: tl.constexpr,
    IDS: tl.constexpr,
):
    """``y[:M, rows] = x[:M] @ W[rows]^T (+ b)`` for the ``BN`` rows of this program;
    ``IDS``: the rows are ``ids[0:N]`` (int64; ``N`` ids, not the weight's rows), each
    written over its own column of ``y``, with the arithmetic of the whole weight's GEMV
    at the same tiles (``ggml_head``: an LM head's largest logits recomputed)."""
    BK: tl.constexpr = NSUB * SB
    WPS: tl.constexpr = SB * LB // 32
    # Words a thread loads per sub-block: what the coalescer gives the activation runs
    # (WPS bf16 a field, at least one element a thread), so both share one layout.
    VEC: tl.constexpr = max(1, min(WPS, NSUB * WPS // (32 * WARPS), 4))
    pid = tl.program_id(0)
    offs_n = pid * BN + tl.arange(0, BN)
    rows = tl.minimum(offs_n, N - 1)  # tail rows re-read the last row; not stored
    if IDS:
        rows = tl.load(ids_ptr + rows)
    lo, hi, d, dm, sc, mn = load_tile(lo_ptr, hi_ptr, d_ptr, dm_ptr, sc_ptr, rows, 0,
                                      K, s_lo, s_sub, s_d, SB, LB, HB, SUPER, MODE, NSUB,
                                      EVEN_K, True, DD, VEC)
    if PDL:
        gdc_wait()  # x (and y's memory) belong to earlier kernels from here on
        gdc_launch_dependents()
    if BM == 1:
        acc = tl.zeros((BN, NSUB), dtype=tl.float32)
    else:
        acc = tl.zeros((BM, BN, NSUB), dtype=tl.float32)
    if PREFETCH:
        for k0 in range(BK, K, BK):
            n_lo, n_hi, n_d, n_dm, n_sc, n_mn = load_tile(
                lo_ptr, hi_ptr, d_ptr, dm_ptr, sc_ptr, rows, k0, K, s_lo, s_sub,
                s_d, SB, LB, HB, SUPER, MODE, NSUB, EVEN_K, True, DD, VEC)
            acc += _gemv_step(lo, hi, d, dm, sc, mn, x_ptr, stride_xm, M, k0 - BK,
                              K, magic, SB, LB, HB, MODE, OFF, LUT, BM, NSUB, EVEN_K)
            lo, hi, d, dm, sc, mn = n_lo, n_hi, n_d, n_dm, n_sc, n_mn
        acc += _gemv_step(lo, hi, d, dm, sc, mn, x_ptr, stride_xm, M,
                          (K - 1) // BK * BK, K, magic, SB, LB, HB, MODE, OFF, LUT, BM, NSUB,
                          EVEN_K)
    else:
        acc += _gemv_step(lo, hi, d, dm, sc, mn, x_ptr, stride_xm, M, 0, K, magic,
                          SB, LB, HB, MODE, OFF, LUT, BM, NSUB, EVEN_K)
        for k0 in range(BK, K, BK):
            lo, hi, d, dm, sc, mn = load_tile(
                lo_ptr, hi_ptr, d_ptr, dm_ptr, sc_ptr, rows, k0, K, s_lo, s_sub,
                s_d, SB, LB, HB, SUPER, MODE, NSUB, EVEN_K, True, DD, VEC)
            acc += _gemv_step(lo, hi, d, dm, sc, mn, x_ptr, stride_xm, M, k0, K, magic,
                              SB, LB, HB, MODE, OFF, LUT, BM, NSUB, EVEN_K)
    y = tl.sum(acc, axis=len(acc.shape) - 1)  # [BN] or [BM, BN]
    if HAS_BIAS:
        y += tl.load(b_ptr + rows).to(tl.float32)
    if BM == 1:
        cols = rows if IDS else offs_n
        tl.store(y_ptr + cols, y.to(y_ptr.dtype.element_ty), mask=offs_n < N)
    else:
        offs_m = tl.arange(0, BM)
        mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
        tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :],
                 y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def ggml_mm_kernel(
    x_ptr, y_ptr, b_ptr, ws_ptr, lo_ptr, hi_ptr, d_ptr, dm_ptr, sc_ptr,
    M, N, K, steps_per, stride_xm, stride_ym, s_lo, s_sub, s_d, magic,
    SB: tl.constexpr, LB: tl.constexpr, HB: tl.constexpr, SUPER: tl.constexpr,
    MODE: tl.constexpr, OFF: tl.constexpr, LUT: tl.constexpr, DD: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, NSUB: tl.constexpr, GROUP_M: tl.constexpr,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, EVICT_FIRST: tl.constexpr,
    SPLIT: tl.constexpr, UPCAST: tl.constexpr, SWAP: tl.constexpr = False,
):
    """The ``[BM, BN]`` tile of ``y = x @ W^T (+ b)``; programs grouped ``GROUP_M`` row
    blocks at a time so a weight tile is reused from L2 by the row blocks that need it.
    ``SPLIT > 1``: program ``(pid, s)`` sums ``steps_per`` K steps from ``s * steps_per *
    BK`` (a multiple of BK, so the loads keep their alignment) into
    ``ws [SPLIT, M, N]`` float32 (``ggml_splitk_reduce`` adds them up, in order): small M
    and N give too few tiles to keep the SMs busy.
    ``SWAP``: the transposed product ``acc [BN, BM] = w @ x^T``, so the weight decoded in
    registers is the dot's A operand (Hopper's wgmma reads A from registers, B only from
    shared memory; and its M of 64 is the weight's rows, not the few rows of x)."""
    BK: tl.constexpr = NSUB * SB
    pid = tl.program_id(0)
    k_lo = tl.program_id(1) * steps_per * BK
    k_hi = tl.minimum(K, k_lo + steps_per * BK)
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    gsize = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % gsize
    pid_n = (pid % width) // gsize
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    rows = tl.minimum(offs_n, N - 1)
    offs_k = tl.arange(0, BK)
    mmask = (offs_m < M)[:, None]  # [BM, 1]
    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]  # [BM, BK]
    if SWAP:
        acc = tl.zeros((BN, BM), dtype=tl.float32)
    else:
        acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BK):
        lo, hi, d, dm, sc, mn = load_tile(lo_ptr, hi_ptr, d_ptr, dm_ptr, sc_ptr, rows,
                                          k0, K, s_lo, s_sub, s_d, SB, LB, HB, SUPER, MODE,
                                          NSUB, EVEN_K, EVICT_FIRST, DD)
        if UPCAST:  # the interpreter's bf16 dot is wrong and its bf16 rounding truncates
            w = tile_weights(lo, hi, d, dm, sc, mn, SB, LB, HB, MODE, OFF, LUT,
                             NSUB, tl.float32, magic)  # [BN, BK]
        else:
            w = tile_weights(lo, hi, d, dm, sc, mn, SB, LB, HB, MODE, OFF, LUT,
                             NSUB, x_ptr.dtype.element_ty, magic)  # [BN, BK]
        if EVEN_K:
            xk = tl.load(x_ptrs + k0, mask=mmask, other=0.0)  # [BM, BK]
        else:
            xk = tl.load(x_ptrs + k0, mask=mmask & ((k0 + offs_k) < K)[None, :], other=0.0)
        if UPCAST:
            xk = xk.to(tl.float32)
        if SWAP:
            acc = tl.dot(w, tl.trans(xk), acc)  # [BN, BM]
        else:
            acc = tl.dot(xk, tl.trans(w), acc)  # [BM, BN]
    if SWAP:
        out = tl.trans(acc)  # [BM, BN]
    else:
        out = acc
    mask = mmask & (offs_n < N)[None, :]
    if SPLIT > 1:
        base = ws_ptr + tl.program_id(1).to(tl.int64) * M * N
        tl.store(base + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :], out, mask=mask)
    else:
        if HAS_BIAS:
            out += tl.load(b_ptr + rows).to(tl.float32)[None, :]
        tl.store(y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :],
                 out.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def ggml_splitk_reduce(ws_ptr, y_ptr, b_ptr, M, N, stride_ym, SPLIT: tl.constexpr,
                       HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """``y = sum_s ws[s] (+ b)`` over ``BLOCK`` elements of ``[M, N]``, splits in order."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    acc = tl.load(ws_ptr + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT):
        acc += tl.load(ws_ptr + s * M * N + offs, mask=mask, other=0.0)
    col = offs % N
    if HAS_BIAS:
        acc += tl.load(b_ptr + col, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + (offs // N) * stride_ym + col, acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def ggml_dequant_kernel(
    out_ptr, ids_ptr, lo_ptr, hi_ptr, d_ptr, dm_ptr, sc_ptr,
    R, N, K, stride_out, s_lo, s_sub, s_d, magic,
    SB: tl.constexpr, LB: tl.constexpr, HB: tl.constexpr, SUPER: tl.constexpr,
    MODE: tl.constexpr, OFF: tl.constexpr, LUT: tl.constexpr, DD: tl.constexpr,
    BN: tl.constexpr, NSUB: tl.constexpr, HAS_IDS: tl.constexpr, EVEN_K: tl.constexpr,
):
    """``out[r, k0 : k0 + BK]`` for ``BN`` output rows: weight row ``ids[r]`` (clamped to
    ``[0, N)``) or ``r``."""
    BK: tl.constexpr = NSUB * SB
    offs_r = tl.program_id(0) * BN + tl.arange(0, BN)
    rr = tl.minimum(offs_r, R - 1)
    if HAS_IDS:
        rows = tl.load(ids_ptr + rr)
        rows = tl.minimum(tl.maximum(rows, 0), N - 1)
    else:
        rows = rr
    k0 = tl.program_id(1) * BK
    lo, hi, d, dm, sc, mn = load_tile(lo_ptr, hi_ptr, d_ptr, dm_ptr, sc_ptr, rows, k0,
                                      K, s_lo, s_sub, s_d, SB, LB, HB, SUPER, MODE, NSUB,
                                      EVEN_K, True, DD)
    w = tile_weights(lo, hi, d, dm, sc, mn, SB, LB, HB, MODE, OFF, LUT, NSUB,
                     out_ptr.dtype.element_ty, magic)  # [BN, BK]
    offs_k = k0 + tl.arange(0, BK)
    mask = (offs_r < R)[:, None] & (offs_k < K)[None, :]
    tl.store(out_ptr + offs_r.to(tl.int64)[:, None] * stride_out + offs_k[None, :], w,
             mask=mask)


@triton.jit
def _i8_load(lo_ptr, d_ptr, dm_ptr, sc_ptr, rows, k0, K, s_lo, s_sub, s_d,
             SUPER: tl.constexpr, MODE: tl.constexpr, OFF: tl.constexpr, NSUB: tl.constexpr,
             EVEN_K: tl.constexpr, WPS: tl.constexpr):
    """One K step of ``ggml_gemv_i8_kernel``: the words ``[BN, NSUB * WPS]`` (2-D: a row's
    words are one contiguous run, which every Triton version lays out four to a thread;
    ``WPS`` words a 32-element sub-block: 4 for 4-bit quants, 8 for Q8_0) and the
    sub-blocks' ``s, m [BN, NSUB]``."""
    sub = k0 // 32 + tl.arange(0, NSUB)  # [NSUB]
    j = k0 // 32 * WPS + tl.arange(0, NSUB * WPS)  # [NSUB * WPS] word index along the row
    offs = rows[:, None] * s_lo + j[None, :]  # [BN, NSUB * WPS]
    kmask = (sub < K // 32)[None, :]  # [1, NSUB]
    if EVEN_K:
        lo = tl.load(lo_ptr + offs, eviction_policy="evict_first")
    else:
        lo = tl.load(lo_ptr + offs, mask=(j < K // 32 * WPS)[None, :], other=0,
                     eviction_policy="evict_first")
    r2 = rows[:, None]
    d_offs = r2 * s_d + (sub // (SUPER // 32))[None, :]
    if MODE == 3:  # the packed int32 (d, dm) of ``PackSpec.dd``
        if EVEN_K:
            dd = tl.load(d_ptr + d_offs)
        else:
            dd = tl.load(d_ptr + d_offs, mask=kmask, other=0)
        d, dm = unpack_dd(dd)
        d, dm = d.to(tl.float32), dm.to(tl.float32)
    elif EVEN_K:
        d = tl.load(d_ptr + d_offs).to(tl.float32)
    else:
        d = tl.load(d_ptr + d_offs, mask=kmask, other=0.0).to(tl.float32)
    if MODE == 0:
        s = d
        m = d * OFF
    elif MODE == 1:
        s = d
        if EVEN_K:
            m = tl.load(dm_ptr + d_offs).to(tl.float32)
        else:
            m = tl.load(dm_ptr + d_offs, mask=kmask, other=0.0).to(tl.float32)
    else:  # MODE 3 (Q4_K: ``PackSpec.dd`` and ``scm``): d * sc, -dm * mn
        sub_offs = r2 * s_sub + sub[None, :]
        if EVEN_K:
            scm = tl.load(sc_ptr + sub_offs, eviction_policy="evict_first")
        else:
            scm = tl.load(sc_ptr + sub_offs, mask=kmask, other=0, eviction_policy="evict_first")
        sc, mn = unpack_scm(scm)
        s = d * sc.to(tl.float32)
        m = -(dm * mn.to(tl.float32))
    return lo, s, m


@triton.jit
def _dp4a(a, b, c, ASM: tl.constexpr):
    """``c + sum_i a.u8[i] * b.s8[i]`` over the four bytes of int32 ``a`` (unsigned) and
    ``b`` (signed): one ``dp4a`` (the interpreter, which runs no PTX: the same sum in
    integer arithmetic)."""
    if ASM:
        out = tl.inline_asm_elementwise("dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r",
                                        [a, b, c], dtype=tl.int32, is_pure=True, pack=1)
    else:
        out = c
        for i in tl.static_range(4):
            out += ((a >> (8 * i)) & 255) * ((b << (24 - 8 * i)) >> 24)
    return out


@triton.jit
def _q8_byte(x, inv, SH: tl.constexpr):
    """``round(x * inv)`` (|.| <= 127) as its two's-complement byte at bits ``SH``: the
    float ``1.5 * 2**23 + r`` holds ``r`` in its low mantissa bits."""
    v = (x * inv + 12582912.0).to(tl.int32, bitcast=True) & 255
    return v << SH


@triton.jit
def _q8_words(x0, x1, x2, x3, x4, x5, x6, x7, NSUB: tl.constexpr, ASM: tl.constexpr,
              W: tl.constexpr = 4):
    """The int8 form of ``NSUB`` 32-element sub-blocks, given as the eight field runs
    ``x0 .. x7`` (float32 ``[NSUB * 4]``: run ``F`` of word ``j`` is the element at
    ``(j // 4) * 32 + j % 4 + 4 * F``); ``W`` 2: 16-element sub-blocks of two words
    (Q6_K's, ``_q8_runs16``). Each sub-block rounded to int8 by its absmax
    (``127 / amax``, as llama.cpp's q8_1), packed to match the weight words (a word's
    even fields, the bytes of ``lo & 0x0F0F0F0F``, pair with runs 0, 2, 4, 6: ``xe``; its
    odd fields with runs 1, 3, 5, 7: ``xd``), with each sub-block's step ``dx = amax /
    127`` and ``sx = dx * sum(int8 x)``. One definition for ``ggml_q8_kernel`` and the
    GEMV's own rounding, so both give the same bits."""
    a = tl.maximum(tl.maximum(tl.maximum(tl.abs(x0), tl.abs(x1)),
                              tl.maximum(tl.abs(x2), tl.abs(x3))),
                   tl.maximum(tl.maximum(tl.abs(x4), tl.abs(x5)),
                              tl.maximum(tl.abs(x6), tl.abs(x7))))
    amax = tl.max(tl.reshape(a, (NSUB, W)), axis=1)  # [NSUB] each sub-block's largest |x|
    inv_s = tl.where(amax > 0, 127.0 / amax, 0.0)  # [NSUB]
    inv = tl.reshape(tl.broadcast_to(inv_s[:, None], (NSUB, W)), (NSUB * W,))
    xe = _q8_byte(x0, inv, 0) | _q8_byte(x2, inv, 8) | _q8_byte(x4, inv, 16) \
        | _q8_byte(x6, inv, 24)
    xd = _q8_byte(x1, inv, 0) | _q8_byte(x3, inv, 8) | _q8_byte(x5, inv, 16) \
        | _q8_byte(x7, inv, 24)
    ones = tl.full(xe.shape, 0x01010101, tl.int32)
    xq = _dp4a(ones, xd, _dp4a(ones, xe, tl.zeros(xe.shape, tl.int32), ASM), ASM)
    xsum = tl.sum(tl.reshape(xq, (NSUB, W)), axis=1)  # [NSUB] sum of the int8 x
    dx = amax * (1.0 / 127.0)
    return xe, xd, dx, xsum.to(tl.float32) * dx


@triton.jit
def _load_runs8(x_ptr, k0, offs, STEP: tl.constexpr, K, EVEN_K: tl.constexpr,
                ACT: tl.constexpr):
    """The eight field runs ``x0 .. x7`` of ``_q8_words``: x at ``offs + F * STEP``."""
    return (load_act_x(x_ptr, k0, offs, K, EVEN_K, ACT),
            load_act_x(x_ptr, k0, offs + STEP, K, EVEN_K, ACT),
            load_act_x(x_ptr, k0, offs + 2 * STEP, K, EVEN_K, ACT),
            load_act_x(x_ptr, k0, offs + 3 * STEP, K, EVEN_K, ACT),
            load_act_x(x_ptr, k0, offs + 4 * STEP, K, EVEN_K, ACT),
            load_act_x(x_ptr, k0, offs + 5 * STEP, K, EVEN_K, ACT),
            load_act_x(x_ptr, k0, offs + 6 * STEP, K, EVEN_K, ACT),
            load_act_x(x_ptr, k0, offs + 7 * STEP, K, EVEN_K, ACT))


@triton.jit
def _q8_words8(x0, x1, x2, x3, NSUB: tl.constexpr, ASM: tl.constexpr):
    """``_q8_words`` for 8-bit weights (Q8_0, ``WPS`` = 8): the four field runs ``x0 ..
    x3`` (run ``F`` of word ``j`` is the element at ``(j // 8) * 32 + j % 8 + 8 * F``)
    packed a byte each into one word ``xw [NSUB * 8]`` that pairs with the weight word
    (its bytes are fields 0-3); the same rounding, step and sum. Returns ``xw`` twice
    (the 4-bit form's two halves), ``dx`` and ``sx``."""
    a = tl.maximum(tl.maximum(tl.abs(x0), tl.abs(x1)), tl.maximum(tl.abs(x2), tl.abs(x3)))
    amax = tl.max(tl.reshape(a, (NSUB, 8)), axis=1)  # [NSUB]
    inv_s = tl.where(amax > 0, 127.0 / amax, 0.0)  # [NSUB]
    inv = tl.reshape(tl.broadcast_to(inv_s[:, None], (NSUB, 8)), (NSUB * 8,))
    xw = _q8_byte(x0, inv, 0) | _q8_byte(x1, inv, 8) | _q8_byte(x2, inv, 16) \
        | _q8_byte(x3, inv, 24)
    ones = tl.full(xw.shape, 0x01010101, tl.int32)
    xq = _dp4a(ones, xw, tl.zeros(xw.shape, tl.int32), ASM)
    xsum = tl.sum(tl.reshape(xq, (NSUB, 8)), axis=1)  # [NSUB]
    dx = amax * (1.0 / 127.0)
    return xw, xw, dx, xsum.to(tl.float32) * dx


@triton.jit
def _q8_runs(x_ptr, k0, K, NSUB: tl.constexpr, EVEN_K: tl.constexpr, ACT: tl.constexpr,
             ASM: tl.constexpr, WPS: tl.constexpr):
    """``_q8_words`` of the ``NSUB`` sub-blocks of x from ``k0`` (masked past ``K``: those
    round to zero). ``ACT`` (``kernels/activation.ACTIVATIONS`` code + 1; 0: none): x is a
    ``[gate (K) | up (K)]`` row and the values are ``act(gate) * up`` with
    ``kernels/activation.py``'s roundings (``kernels/gemv.load_act_x``), so the int8
    rounding sees what the activation kernel would have written. ``WPS``: 4 (4-bit
    weights, ``_q8_words``) or 8 (Q8_0, ``_q8_words8``)."""
    # One return: the compiler types every return statement of a function, a constexpr
    # branch's included, and the two forms differ in shape.
    if WPS == 8:
        j8 = tl.arange(0, NSUB * 8)
        o8 = (j8 // 8) * 32 + j8 % 8  # [NSUB * 8]: field 0's element of each word
        xe, xd, dx, sx = _q8_words8(load_act_x(x_ptr, k0, o8, K, EVEN_K, ACT),
                                    load_act_x(x_ptr, k0, o8 + 8, K, EVEN_K, ACT),
                                    load_act_x(x_ptr, k0, o8 + 16, K, EVEN_K, ACT),
                                    load_act_x(x_ptr, k0, o8 + 24, K, EVEN_K, ACT), NSUB, ASM)
    else:
        xe, xd, dx, sx = _q8_runs4(x_ptr, k0, K, NSUB, EVEN_K, ACT, ASM)
    return xe, xd, dx, sx


@triton.jit
def _q8_runs4(x_ptr, k0, K, NSUB: tl.constexpr, EVEN_K: tl.constexpr, ACT: tl.constexpr,
              ASM: tl.constexpr):
    """``_q8_runs`` for 4-bit weights (``_q8_words``)."""
    j = tl.arange(0, NSUB * 4)
    offs = (j // 4) * 32 + j % 4  # [NSUB * 4]: field 0's element of each word
    x0, x1, x2, x3, x4, x5, x6, x7 = _load_runs8(x_ptr, k0, offs, 4, K, EVEN_K, ACT)
    return _q8_words(x0, x1, x2, x3, x4, x5, x6, x7, NSUB, ASM)


@triton.jit
def _i8_step(lo, s, m, x_ptr, xs_ptr, k0, K, NSUB: tl.constexpr, EVEN_K: tl.constexpr,
             ASM: tl.constexpr, ACT: tl.constexpr, XQ: tl.constexpr, WPS: tl.constexpr):
    """``[BN, NSUB]``: each sub-block's ``s * sum(q x) + m * sum(x)`` for one K step, with
    the activations in int8 per 32-element sub-block (``_q8_words``) and the products
    summed by ``dp4a``: two masks, a shift and two dp4a for a word's eight elements. The
    ``m * sum(x)`` term sums the same rounded activations, so the result is exactly the
    product with the rounded x (an error in proportion to the weights, not to ``q`` and
    ``m`` apart, which cancel). ``XQ``: x is already in that form (``ggml_q8_kernel``'s
    words at ``x_ptr``, steps at ``xs_ptr``); else this program rounds it. ``WPS`` 8
    (Q8_0): a word's four bytes are four elements' unsigned quants, one dp4a each."""
    BN: tl.constexpr = lo.shape[0]
    if XQ and WPS == 8:
        j = k0 // 4 + tl.arange(0, NSUB * 8)  # [NSUB * 8] word index
        sub = k0 // 32 + tl.arange(0, NSUB)  # [NSUB]
        if EVEN_K:
            xe = tl.load(x_ptr + j, eviction_policy="evict_last")
            dx = tl.load(xs_ptr + sub, eviction_policy="evict_last")
            sx = tl.load(xs_ptr + K // 32 + sub, eviction_policy="evict_last")
        else:
            xe = tl.load(x_ptr + j, mask=j < K // 4, other=0, eviction_policy="evict_last")
            dx = tl.load(xs_ptr + sub, mask=sub < K // 32, other=0.0,
                         eviction_policy="evict_last")
            sx = tl.load(xs_ptr + K // 32 + sub, mask=sub < K // 32, other=0.0,
                         eviction_policy="evict_last")
        xd = xe
    elif XQ:
        j = k0 // 8 + tl.arange(0, NSUB * 4)  # [NSUB * 4] word index
        sub = k0 // 32 + tl.arange(0, NSUB)  # [NSUB]
        if EVEN_K:
            xe = tl.load(x_ptr + j, eviction_policy="evict_last")
            xd = tl.load(x_ptr + K // 8 + j, eviction_policy="evict_last")
            dx = tl.load(xs_ptr + sub, eviction_policy="evict_last")
            sx = tl.load(xs_ptr + K // 32 + sub, eviction_policy="evict_last")
        else:
            xe = tl.load(x_ptr + j, mask=j < K // 8, other=0, eviction_policy="evict_last")
            xd = tl.load(x_ptr + K // 8 + j, mask=j < K // 8, other=0,
                         eviction_policy="evict_last")
            dx = tl.load(xs_ptr + sub, mask=sub < K // 32, other=0.0,
                         eviction_policy="evict_last")
            sx = tl.load(xs_ptr + K // 32 + sub, mask=sub < K // 32, other=0.0,
                         eviction_policy="evict_last")
    else:
        xe, xd, dx, sx = _q8_runs(x_ptr, k0, K, NSUB, EVEN_K, ACT, ASM, WPS)
    if WPS == 8:
        acc = _dp4a(lo, xe[None, :], tl.zeros(lo.shape, dtype=tl.int32), ASM)
    else:
        acc = _dp4a(lo & 0x0F0F0F0F, xe[None, :], tl.zeros(lo.shape, dtype=tl.int32), ASM)
        acc = _dp4a((lo >> 4) & 0x0F0F0F0F, xd[None, :], acc, ASM)
    isum = tl.sum(tl.reshape(acc, (BN, NSUB, WPS)), axis=2)  # [BN, NSUB]
    return isum.to(tl.float32) * (s * dx[None, :]) + sx[None, :] * m


@triton.jit
def q8_store(x_ptr, q_ptr, s_ptr, k0, K, NSUB: tl.constexpr, EVEN_K: tl.constexpr,
             ASM: tl.constexpr, ACT: tl.constexpr, WPS: tl.constexpr):
    """The ``NSUB`` sub-blocks of x from ``k0`` in the int8 form ``ggml_gemv_i8_kernel``
    reads with ``XQ``: words ``q [2, K / 8]`` int32 (``xe`` then ``xd``; one run ``[K / 4]``
    for ``WPS`` 8, ``_q8_words8``) and float32 ``s [2, K / 32]`` (``dx`` then ``sx``).
    ``ggml_q8_kernel``'s body, and the RMSNorm kernel's (``kernels/rmsnorm.py``, ``Q8``)
    for its own output row: one definition, the same bits."""
    xe, xd, dx, sx = _q8_runs(x_ptr, k0, K, NSUB, EVEN_K, ACT, ASM, WPS)
    sub = k0 // 32 + tl.arange(0, NSUB)
    if WPS == 8:  # (if / else, no early return: see _q8_runs)
        j8 = k0 // 4 + tl.arange(0, NSUB * 8)
        if EVEN_K:
            tl.store(q_ptr + j8, xe)
        else:
            tl.store(q_ptr + j8, xe, mask=j8 < K // 4)
    else:
        j = k0 // 8 + tl.arange(0, NSUB * 4)
        if EVEN_K:
            tl.store(q_ptr + j, xe)
            tl.store(q_ptr + K // 8 + j, xd)
        else:
            tl.store(q_ptr + j, xe, mask=j < K // 8)
            tl.store(q_ptr + K // 8 + j, xd, mask=j < K // 8)
    if EVEN_K:
        tl.store(s_ptr + sub, dx)
        tl.store(s_ptr + K // 32 + sub, sx)
    else:
        tl.store(s_ptr + sub, dx, mask=sub < K // 32)
        tl.store(s_ptr + K // 32 + sub, sx, mask=sub < K // 32)


@triton.jit
def ggml_q8_kernel(x_ptr, q_ptr, s_ptr, K, NSUB: tl.constexpr, EVEN_K: tl.constexpr,
                   ASM: tl.constexpr, ACT: tl.constexpr, PDL: tl.constexpr,
                   WPS: tl.constexpr, EARLY: tl.constexpr):
    """One row of activations (``[K]``, or a ``[gate | up]`` row of ``2K`` with ``ACT``)
    in the int8 form ``ggml_gemv_i8_kernel`` reads with ``XQ`` (``q8_store``), for
    ``NSUB`` sub-blocks a program. Rounded once here instead of once in every GEMV
    program."""
    k0 = tl.program_id(0) * NSUB * 32
    if PDL:  # x comes from the GEMV before; the next one's first weight tile is read meanwhile
        gdc_enter(EARLY)
    q8_store(x_ptr, q_ptr, s_ptr, k0, K, NSUB, EVEN_K, ASM, ACT, WPS)


@triton.jit
def ggml_gemv_i8_kernel(
    x_ptr, xs_ptr, y_ptr, b_ptr, lo_ptr, d_ptr, dm_ptr, sc_ptr, ws_ptr, sem_ptr,
    N, K, s_lo, s_sub, s_d,
    SUPER: tl.constexpr, MODE: tl.constexpr, OFF: tl.constexpr,
    BN: tl.constexpr, NSUB: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
    PREFETCH: tl.constexpr, PDL: tl.constexpr, WIDE: tl.constexpr, ASM: tl.constexpr,
    ACT: tl.constexpr, XQ: tl.constexpr, WPS: tl.constexpr, SPLIT: tl.constexpr,
    STEPS: tl.constexpr,
):
    """``y[0, rows] = x[0] @ W[rows]^T (+ b)`` for one input row and the plain 4-bit types
    (Q4_0, Q4_1, Q4_K: 32-element sub-blocks of four words, no high bits, no table) and
    Q8_0 (``WPS`` = 8 words a sub-block, a byte an element): the batch-1 decode path. A
    thread holds whole sub-blocks (one 16-byte load each) of all ``BN`` rows, rounds
    their activations to int8 once and sums each sub-block with ``dp4a`` (``_i8_step``):
    about 2.7 instructions an element of Q4_K against the float path's 6.4, so the
    kernel streams the weights instead of waiting on its own issue slots.
    ``WIDE``: 64-bit row offsets (a weight past 2**31 words); ``ASM``: dp4a in PTX (off
    under the interpreter); ``ACT``: x is a gate_up row, the gated activation applied on
    load (``_q8_runs``); ``XQ``: x arrives rounded (``ggml_q8_kernel``: words at ``x_ptr``,
    steps at ``xs_ptr``), so no program repeats that work.

    ``SPLIT`` > 1: K is cut into ``SPLIT`` runs of ``STEPS`` steps, one program each
    (program ``pid``: rows ``pid // SPLIT``, run ``pid % SPLIT``), so a weight of few
    rows still has enough programs in flight to stream at the copy rate. Each program
    stores its float32 partial sums in ``ws [SPLIT, N]`` and counts itself in
    ``sem[pid // SPLIT]``; the last of a row block to arrive adds the partials in run
    order (the same bits whatever the arrival order), writes ``y`` and sets the count
    back to zero for the next call. Calls on one ``sem`` must be stream-ordered."""
    BK: tl.constexpr = NSUB * 32
    blk, k_lo, k_hi, offs_n, rows = _i8_program(N, K, BN, BK, SPLIT, STEPS, WIDE)
    lo, s, m = _i8_load(lo_ptr, d_ptr, dm_ptr, sc_ptr, rows, k_lo, K, s_lo, s_sub, s_d,
                        SUPER, MODE, OFF, NSUB, EVEN_K, WPS)
    if PDL:
        gdc_wait()  # x (and y's memory) belong to earlier kernels from here on
        gdc_launch_dependents()
    if PREFETCH:
        acc = tl.zeros((BN, NSUB), dtype=tl.float32)
        for k0 in range(k_lo + BK, k_hi, BK):
            n_lo, n_s, n_m = _i8_load(lo_ptr, d_ptr, dm_ptr, sc_ptr, rows, k0, K,
                                      s_lo, s_sub, s_d, SUPER, MODE, OFF, NSUB, EVEN_K, WPS)
            acc += _i8_step(lo, s, m, x_ptr, xs_ptr, k0 - BK, K, NSUB, EVEN_K, ASM, ACT,
                            XQ, WPS)
            lo, s, m = n_lo, n_s, n_m
        acc += _i8_step(lo, s, m, x_ptr, xs_ptr, k_lo + (k_hi - k_lo - 1) // BK * BK, K,
                        NSUB, EVEN_K, ASM, ACT, XQ, WPS)
    else:
        acc = _i8_step(lo, s, m, x_ptr, xs_ptr, k_lo, K, NSUB, EVEN_K, ASM, ACT, XQ, WPS)
        for k0 in range(k_lo + BK, k_hi, BK):
            lo, s, m = _i8_load(lo_ptr, d_ptr, dm_ptr, sc_ptr, rows, k0, K, s_lo,
                                s_sub, s_d, SUPER, MODE, OFF, NSUB, EVEN_K, WPS)
            acc += _i8_step(lo, s, m, x_ptr, xs_ptr, k0, K, NSUB, EVEN_K, ASM, ACT, XQ, WPS)
    _i8_out(tl.sum(acc, axis=1), ws_ptr, sem_ptr, y_ptr, b_ptr, offs_n, rows, blk, N, SPLIT,
            HAS_BIAS)


@triton.jit
def _i8_program(N, K, BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr,
                STEPS: tl.constexpr, WIDE: tl.constexpr):
    """This program's share of an int8 GEMV (``ggml_gemv_i8_kernel``,
    ``ggml_gemv_i8_q6_kernel``): row block ``blk`` and K run ``[k_lo, k_hi)`` (program
    ``pid``: block ``pid // SPLIT``, run ``pid % SPLIT`` of ``STEPS`` steps of ``BK``), its
    rows ``offs_n`` and the rows it reads (``rows``: the tail re-reads row ``N - 1``; 64-bit
    with ``WIDE``)."""
    pid = tl.program_id(0)
    if SPLIT > 1:
        blk = pid // SPLIT
        k_lo = (pid % SPLIT) * (STEPS * BK)
        k_hi = tl.minimum(K, k_lo + STEPS * BK)
    else:
        blk = pid
        k_lo = 0
        k_hi = K
    offs_n = blk * BN + tl.arange(0, BN)
    rows = tl.minimum(offs_n, N - 1)
    if WIDE:
        rows = rows.to(tl.int64)
    return blk, k_lo, k_hi, offs_n, rows


@triton.jit
def _i8_out(y, ws_ptr, sem_ptr, y_ptr, b_ptr, offs_n, rows, blk, N, SPLIT: tl.constexpr,
            HAS_BIAS: tl.constexpr):
    """A row block's sums ``y [BN]`` out: into ``y`` (plus the bias), or with ``SPLIT`` > 1
    as run ``pid % SPLIT``'s partials (``_i8_split_out``)."""
    if SPLIT > 1:
        _i8_split_out(y, ws_ptr, sem_ptr, y_ptr, b_ptr, offs_n, rows, blk,
                      tl.program_id(0) % SPLIT, N, SPLIT, HAS_BIAS)
    else:
        if HAS_BIAS:
            y += tl.load(b_ptr + rows).to(tl.float32)
        tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=offs_n < N)


@triton.jit
def _i8_split_out(y, ws_ptr, sem_ptr, y_ptr, b_ptr, offs_n, rows, blk, run, N,
                  SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Run ``run``'s partial sums ``y [BN]`` of row block ``blk`` into ``ws [SPLIT, N]``,
    then the count: the last run to arrive adds all of them in order, writes ``y`` and
    sets the count back to zero (``ggml_gemv_i8_kernel``, ``SPLIT``)."""
    nmask = offs_n < N
    tl.store(ws_ptr + run * N + offs_n, y, mask=nmask)
    tl.debug_barrier()  # every thread's partial is written before the count
    arrived = tl.atomic_add(sem_ptr + blk, 1, sem="acq_rel", scope="gpu")
    if arrived == SPLIT - 1:  # the last run of this row block: add them all
        y = tl.load(ws_ptr + offs_n, mask=nmask, other=0.0, cache_modifier=".cg")
        for r in tl.static_range(1, SPLIT):
            y += tl.load(ws_ptr + r * N + offs_n, mask=nmask, other=0.0, cache_modifier=".cg")
        if HAS_BIAS:
            y += tl.load(b_ptr + rows).to(tl.float32)
        tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=nmask)
        tl.atomic_xchg(sem_ptr + blk, 0, sem="relaxed", scope="gpu")


# ----- Q6_K at one row: 16-element sub-blocks with two high bits -------------------------


@triton.jit
def _q8_runs16(x_ptr, k0, K, NSUB: tl.constexpr, EVEN_K: tl.constexpr, ACT: tl.constexpr,
               ASM: tl.constexpr):
    """``_q8_runs4`` for Q6_K's words (two a 16-element sub-block: field ``F`` of word ``w``
    is element ``2 F + w``), rounded per 16 elements, the granularity of Q6_K's scales:
    ``xe, xd [NSUB * 2]`` (the even and the odd fields' bytes), ``dx, sx [NSUB]``."""
    j = tl.arange(0, NSUB * 2)
    offs = (j // 2) * 16 + j % 2  # [NSUB * 2]: field 0's element of each word
    x0, x1, x2, x3, x4, x5, x6, x7 = _load_runs8(x_ptr, k0, offs, 2, K, EVEN_K, ACT)
    return _q8_words(x0, x1, x2, x3, x4, x5, x6, x7, NSUB, ASM, 2)


@triton.jit
def _bytes_of_nibbles(t):
    """The four nibbles of ``t``'s low 16 bits, one to a byte (nibble ``i`` -> byte ``i``)."""
    u = (t & 0xFF) | ((t & 0xFF00) << 8)
    return (u & 0x000F000F) | ((u & 0x00F000F0) << 4)


@triton.jit
def _q6_load(lo_ptr, hi_ptr, d_ptr, sc_ptr, rows, k0, K, s_lo, s_sub, s_d,
             NSUB: tl.constexpr, EVEN_K: tl.constexpr):
    """One K step of ``ggml_gemv_i8_q6_kernel``: the low words ``[BN, NSUB * 2]``, the
    high-bit words ``[BN, NSUB]`` (``ggml_pack``: word ``w``'s field ``f`` at bits
    ``2 (8 w + f)``) and each sub-block's step ``s = d * sc [BN, NSUB]``."""
    sub = k0 // 16 + tl.arange(0, NSUB)  # [NSUB]
    j = k0 // 8 + tl.arange(0, NSUB * 2)  # [NSUB * 2] word index along the row
    r2 = rows[:, None]
    lo_offs = r2 * s_lo + j[None, :]
    sub_offs = r2 * s_sub + sub[None, :]
    d_offs = r2 * s_d + (sub // 16)[None, :]  # 16 sub-blocks a 256-element block
    if EVEN_K:
        lo = tl.load(lo_ptr + lo_offs, eviction_policy="evict_first")
        hi = tl.load(hi_ptr + sub_offs, eviction_policy="evict_first")
        sc = tl.load(sc_ptr + sub_offs, eviction_policy="evict_first")
        dd = tl.load(d_ptr + d_offs)
    else:
        kmask = (sub < K // 16)[None, :]
        lo = tl.load(lo_ptr + lo_offs, mask=(j < K // 8)[None, :], other=0,
                     eviction_policy="evict_first")
        hi = tl.load(hi_ptr + sub_offs, mask=kmask, other=0, eviction_policy="evict_first")
        sc = tl.load(sc_ptr + sub_offs, mask=kmask, other=0, eviction_policy="evict_first")
        dd = tl.load(d_ptr + d_offs, mask=kmask, other=0)
    d, _dm = unpack_dd(dd)
    return lo, hi, d.to(tl.float32) * sc.to(tl.float32)


@triton.jit
def _q6_step(lo, hi, s, x_ptr, k0, K, NSUB: tl.constexpr, EVEN_K: tl.constexpr,
             ASM: tl.constexpr, ACT: tl.constexpr):
    """``[BN, NSUB]``: each sub-block's ``s * (sum(q x) - 32 sum(x))`` with x in int8 per
    16 elements: a word's unsigned 6-bit quants are its low nibbles with their two high
    bits spread in (the even fields' bytes, then the odd ones'), two dp4a a word."""
    BN: tl.constexpr = lo.shape[0]
    xe, xd, dx, sx = _q8_runs16(x_ptr, k0, K, NSUB, EVEN_K, ACT, ASM)
    hw = tl.reshape(tl.broadcast_to(hi[:, :, None], (BN, NSUB, 2)), (BN, NSUB * 2))
    hw = (hw >> (16 * (tl.arange(0, NSUB * 2) % 2))[None, :]) & 0xFFFF  # word w's 16 bits
    qe = (lo & 0x0F0F0F0F) | (_bytes_of_nibbles(hw & 0x3333) << 4)
    qo = ((lo >> 4) & 0x0F0F0F0F) | (_bytes_of_nibbles((hw >> 2) & 0x3333) << 4)
    acc = _dp4a(qe, xe[None, :], tl.zeros(lo.shape, dtype=tl.int32), ASM)
    acc = _dp4a(qo, xd[None, :], acc, ASM)
    isum = tl.sum(tl.reshape(acc, (BN, NSUB, 2)), axis=2)  # [BN, NSUB]
    return s * (isum.to(tl.float32) * dx[None, :] - 32.0 * sx[None, :])


@triton.jit
def ggml_gemv_i8_q6_kernel(
    x_ptr, y_ptr, b_ptr, lo_ptr, hi_ptr, d_ptr, sc_ptr, ws_ptr, sem_ptr,
    N, K, s_lo, s_sub, s_d,
    BN: tl.constexpr, NSUB: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
    PDL: tl.constexpr, WIDE: tl.constexpr, ASM: tl.constexpr, ACT: tl.constexpr,
    SPLIT: tl.constexpr, STEPS: tl.constexpr,
):
    """``ggml_gemv_i8_kernel`` for Q6_K (16-element sub-blocks, 4 low and 2 high bits an
    element, an int8 scale each): one input row, x rounded to int8 per 16 elements by
    each program (``ACT``: a gate_up row, the gated activation applied on load), the
    products summed by ``dp4a`` (``_q6_step``); ``NSUB`` sub-blocks a K step, K split
    over ``SPLIT`` programs as there (``_i8_split_out``)."""
    BK: tl.constexpr = NSUB * 16
    blk, k_lo, k_hi, offs_n, rows = _i8_program(N, K, BN, BK, SPLIT, STEPS, WIDE)
    lo, hi, s = _q6_load(lo_ptr, hi_ptr, d_ptr, sc_ptr, rows, k_lo, K, s_lo, s_sub, s_d,
                         NSUB, EVEN_K)
    if PDL:
        gdc_wait()  # x (and y's memory) belong to earlier kernels from here on
        gdc_launch_dependents()
    acc = _q6_step(lo, hi, s, x_ptr, k_lo, K, NSUB, EVEN_K, ASM, ACT)
    for k0 in range(k_lo + BK, k_hi, BK):
        lo, hi, s = _q6_load(lo_ptr, hi_ptr, d_ptr, sc_ptr, rows, k0, K, s_lo, s_sub, s_d,
                             NSUB, EVEN_K)
        acc += _q6_step(lo, hi, s, x_ptr, k0, K, NSUB, EVEN_K, ASM, ACT)
    _i8_out(tl.sum(acc, axis=1), ws_ptr, sem_ptr, y_ptr, b_ptr, offs_n, rows, blk, N, SPLIT,
            HAS_BIAS)

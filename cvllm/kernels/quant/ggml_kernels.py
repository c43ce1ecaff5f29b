"""The float Triton kernels over split GGML weights: batch GEMV, tensor-core GEMM,
dequantize (the int8 GEMVs of one row are ``ggml_i8_kernels``).

Launched only by ``ggml_cuda.py`` (which checks every input first and takes the tiles
``ggml_plan`` chooses); the tile decoding they share is ``ggml_tiles.py``. Weight fields
are the layout of ``ggml_pack.py``; ``x`` rows are contiguous, ``y`` rows too. No state.

- ``ggml_gemv_kernel``: ``BM`` (1..16) input rows against ``BN`` weight rows a program,
  float32 FMA in registers: each program streams its rows' blocks once, sums ``q * x``
  over each scale sub-block, then scales once per sub-block. One stage of register
  prefetch (``PREFETCH``: the next K step's fields are loaded before this one is
  reduced) and programmatic dependent launch (``PDL``: the first tile is in flight
  before the kernel that wrote ``x`` has finished, as in ``kernels/gemv.py``).
- ``ggml_mm_kernel``: a ``[BM, BN]`` output tile a program; each weight tile is decoded
  in registers to x's dtype and fed to ``tl.dot`` (tensor cores), float32 accumulator;
  ``ggml_splitk_reduce`` adds the partial sums of a K split.
- ``ggml_dequant_kernel``: rows of the weight (all, or those named by token ids) into a
  dense ``[R, K]`` tensor; the large-M path (then cuBLAS) and the embedding.
"""

from __future__ import annotations

import triton
import triton.language as tl

from cvllm.kernels.pdl import gdc_launch_dependents, gdc_wait
from cvllm.kernels.quant.ggml_tiles import (
    field_shift, field_values, load_tile, tile_prep, tile_scales, tile_weights,
)


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

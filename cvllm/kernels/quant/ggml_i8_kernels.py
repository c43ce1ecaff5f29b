"""The int8 GEMVs of one activation row over split GGML weights (Triton): the batch-1
decode path of Q4_0 / Q4_1 / Q4_K / Q8_0 (``ggml_gemv_i8_kernel``) and Q6_K
(``ggml_gemv_i8_q6_kernel``).

Launched only by ``ggml_cuda.py`` (inputs checked, tiles and K split from ``ggml_plan``).
The activations are rounded to int8 per sub-block (``ggml_q8``: by each program, or once
beforehand by ``ggml_q8_kernel`` or the RMSNorm) and the products summed by ``dp4a``.
With K split over programs, the last of a row block to arrive adds the partial sums; the
arrival counts are the weight's ``sem`` (``ggml_cuda.CudaGgmlWeight``), back at zero
after every call. No other state.
"""

from __future__ import annotations

import triton
import triton.language as tl

from cvllm.kernels.pdl import gdc_launch_dependents, gdc_wait
from cvllm.kernels.quant.ggml_q8 import dp4a, q8_runs, q8_runs16
from cvllm.kernels.quant.ggml_tiles import unpack_dd, unpack_scm


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
        xe, xd, dx, sx = q8_runs(x_ptr, k0, K, NSUB, EVEN_K, ACT, ASM, WPS)
    if WPS == 8:
        acc = dp4a(lo, xe[None, :], tl.zeros(lo.shape, dtype=tl.int32), ASM)
    else:
        acc = dp4a(lo & 0x0F0F0F0F, xe[None, :], tl.zeros(lo.shape, dtype=tl.int32), ASM)
        acc = dp4a((lo >> 4) & 0x0F0F0F0F, xd[None, :], acc, ASM)
    isum = tl.sum(tl.reshape(acc, (BN, NSUB, WPS)), axis=2)  # [BN, NSUB]
    return isum.to(tl.float32) * (s * dx[None, :]) + sx[None, :] * m


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
    load (``q8_runs``); ``XQ``: x arrives rounded (``ggml_q8_kernel``: words at ``x_ptr``,
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
    xe, xd, dx, sx = q8_runs16(x_ptr, k0, K, NSUB, EVEN_K, ACT, ASM)
    hw = tl.reshape(tl.broadcast_to(hi[:, :, None], (BN, NSUB, 2)), (BN, NSUB * 2))
    hw = (hw >> (16 * (tl.arange(0, NSUB * 2) % 2))[None, :]) & 0xFFFF  # word w's 16 bits
    qe = (lo & 0x0F0F0F0F) | (_bytes_of_nibbles(hw & 0x3333) << 4)
    qo = ((lo >> 4) & 0x0F0F0F0F) | (_bytes_of_nibbles((hw >> 2) & 0x3333) << 4)
    acc = dp4a(qe, xe[None, :], tl.zeros(lo.shape, dtype=tl.int32), ASM)
    acc = dp4a(qo, xd[None, :], acc, ASM)
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

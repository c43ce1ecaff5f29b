"""The int8 form of an activation row in Triton: each 32-element sub-block (Q6_K: 16)
rounded to int8 by its absmax (llama.cpp's q8_1), packed to pair with the weight words of
``ggml_pack``, with its step and the sum of its int8 values.

One definition for every place that rounds: the int8 GEMVs' own programs
(``ggml_i8_kernels``: ``q8_runs``, ``q8_runs16``), the kernel of its own that rounds a
row once before the GEMV (``ggml_q8_kernel``, launched by ``q8form.quantize_q8``) and the
RMSNorm kernel that writes the form beside its output (``kernels/rmsnorm.py``:
``q8_store``), so all give the same bits. ``dp4a`` (the four-byte dot product the GEMVs
sum with) lives here too: the rounding sums its int8 values with it. No state.
"""

from __future__ import annotations

import triton
import triton.language as tl

from cvllm.kernels.gemv import load_act_x
from cvllm.kernels.pdl import gdc_enter


@triton.jit
def dp4a(a, b, c, ASM: tl.constexpr):
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
    (Q6_K's, ``q8_runs16``). Each sub-block rounded to int8 by its absmax
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
    xq = dp4a(ones, xd, dp4a(ones, xe, tl.zeros(xe.shape, tl.int32), ASM), ASM)
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
    xq = dp4a(ones, xw, tl.zeros(xw.shape, tl.int32), ASM)
    xsum = tl.sum(tl.reshape(xq, (NSUB, 8)), axis=1)  # [NSUB]
    dx = amax * (1.0 / 127.0)
    return xw, xw, dx, xsum.to(tl.float32) * dx


@triton.jit
def q8_runs(x_ptr, k0, K, NSUB: tl.constexpr, EVEN_K: tl.constexpr, ACT: tl.constexpr,
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
    """``q8_runs`` for 4-bit weights (``_q8_words``)."""
    j = tl.arange(0, NSUB * 4)
    offs = (j // 4) * 32 + j % 4  # [NSUB * 4]: field 0's element of each word
    x0, x1, x2, x3, x4, x5, x6, x7 = _load_runs8(x_ptr, k0, offs, 4, K, EVEN_K, ACT)
    return _q8_words(x0, x1, x2, x3, x4, x5, x6, x7, NSUB, ASM)


@triton.jit
def q8_runs16(x_ptr, k0, K, NSUB: tl.constexpr, EVEN_K: tl.constexpr, ACT: tl.constexpr,
               ASM: tl.constexpr):
    """``_q8_runs4`` for Q6_K's words (two a 16-element sub-block: field ``F`` of word ``w``
    is element ``2 F + w``), rounded per 16 elements, the granularity of Q6_K's scales:
    ``xe, xd [NSUB * 2]`` (the even and the odd fields' bytes), ``dx, sx [NSUB]``."""
    j = tl.arange(0, NSUB * 2)
    offs = (j // 2) * 16 + j % 2  # [NSUB * 2]: field 0's element of each word
    x0, x1, x2, x3, x4, x5, x6, x7 = _load_runs8(x_ptr, k0, offs, 2, K, EVEN_K, ACT)
    return _q8_words(x0, x1, x2, x3, x4, x5, x6, x7, NSUB, ASM, 2)


@triton.jit
def q8_store(x_ptr, q_ptr, s_ptr, k0, K, NSUB: tl.constexpr, EVEN_K: tl.constexpr,
             ASM: tl.constexpr, ACT: tl.constexpr, WPS: tl.constexpr):
    """The ``NSUB`` sub-blocks of x from ``k0`` in the int8 form ``ggml_gemv_i8_kernel``
    reads with ``XQ``: words ``q [2, K / 8]`` int32 (``xe`` then ``xd``; one run ``[K / 4]``
    for ``WPS`` 8, ``_q8_words8``) and float32 ``s [2, K / 32]`` (``dx`` then ``sx``).
    ``ggml_q8_kernel``'s body, and the RMSNorm kernel's (``kernels/rmsnorm.py``, ``Q8``)
    for its own output row: one definition, the same bits."""
    xe, xd, dx, sx = q8_runs(x_ptr, k0, K, NSUB, EVEN_K, ACT, ASM, WPS)
    sub = k0 // 32 + tl.arange(0, NSUB)
    if WPS == 8:  # (if / else, no early return: see q8_runs)
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

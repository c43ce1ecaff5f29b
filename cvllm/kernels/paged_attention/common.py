"""What the paged-attention kernels share: the cache layout, the dtypes they take, the
``triton.jit`` helpers of the decode and prefill loops and their tile plans.

Layout (same as the torch reference backend): a cache is ``[N, bs, Hkv, D]``; token slot
``s`` lives at ``cache[s // bs, s % bs]``; ``block_tables[b, j]`` is sequence b's j-th
block. Sequence b's ``q_len`` queries sit at positions ``seq_len - q_len .. seq_len - 1``
and see key j iff ``j <= pos`` and, with a window W, ``j > pos - W``. Keys are only ever
read through masked loads, so never-written or freed (clamped-to-0) blocks outside a
sequence's visible range cannot leak into its output, not even as NaN.

Scores are float32 throughout: ``s = scale * q.k``, then ``softcap * tanh(s / softcap)``,
then the softmax in base 2.

FP8 caches (``torch.float8_e4m3fn``, ``--fp8-kvcache``): every kernel then takes
``k_scale`` / ``v_scale``, one float32 per tensor on the device (read by the kernel, so a
new value needs no recompile and no CUDA graph recapture). The write stores
``clamp(x / scale, +-448)``; the reads cast the e4m3 tile to q's dtype for ``tl.dot`` and
fold the scales into the math instead of rescaling every element: ``k_scale`` into the
score scale, ``v_scale`` into the normalised output (attention is linear in V).
"""

from __future__ import annotations

from typing import Tuple

import torch
import triton
import triton.language as tl

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)
FP8_DTYPE = torch.float8_e4m3fn
CACHE_DTYPES = FLOAT_DTYPES + (FP8_DTYPE,)
STAGES = 2
"""Software-pipelining depth of the K/V loads in the decode and prefill loops."""
SMEM_BUDGET = 128 * 1024
"""Shared memory a tile plan may use (H100/H200 allow 227 KB per program): headroom for
the compiler's own scratch and layout conversions."""


# ----- device helpers of the decode and prefill loops ------------------------------------


@triton.jit
def tile_dot(a, b, IEEE_F32: tl.constexpr):
    # float32 inputs would otherwise go through TF32 on Hopper (10-bit mantissa).
    if IEEE_F32:
        r = tl.dot(a, b, input_precision="ieee")
    else:
        r = tl.dot(a, b)
    return r


@triton.jit
def tile_scores(q, k, scale, softcap, USE_SOFTCAP: tl.constexpr, IEEE_F32: tl.constexpr):
    """``[R, D] x [C, D] -> [R, C]`` float32 scores in log2 units, soft-capped."""
    s = tile_dot(q, tl.trans(k), IEEE_F32) * scale
    if USE_SOFTCAP:
        # tanh(x) = 1 - 2 / (exp(2x) + 1): saturates cleanly to +-1 when exp overflows.
        s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))
    return s * 1.4426950408889634  # log2(e): the softmax runs on exp2


@triton.jit
def load_kv_tile(cache_ptr, block_tables_ptr, pos, pmask, offs_d, dmask, kv_head,
                  block_size, stride_n, stride_b, stride_h):
    """Keys (or values) at positions ``pos [C]`` of one sequence -> ``[C, BLOCK_D]``;
    ``block_tables_ptr`` points at that sequence's row."""
    blk = tl.load(block_tables_ptr + pos // block_size, mask=pmask, other=0).to(tl.int64)
    row = blk * stride_n + (pos % block_size).to(tl.int64) * stride_b + kv_head * stride_h
    ptrs = cache_ptr + row[:, None] + offs_d[None, :]
    return tl.load(ptrs, mask=pmask[:, None] & dmask[None, :], other=0.0)


@triton.jit
def online_softmax_step(s, m_i, l_i, acc, v, IEEE_F32: tl.constexpr):
    """Fold one tile of (masked, log2) scores ``s [R, C]`` and values ``v [C, D]`` into
    the running max ``m_i [R]``, sum ``l_i [R]`` and output ``acc [R, D]``."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])  # masked scores are -inf -> exactly 0
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tile_dot(p.to(v.dtype), v, IEEE_F32)
    return m_new, l_i, acc


# ----- tile plans ------------------------------------------------------------------------


def fit_tiles(block_m: int, block_n: int, block_d: int, elt_bytes: int,
              shrink_m: bool) -> Tuple[int, int]:
    """Halve BLOCK_N, then (if allowed) BLOCK_M, down to 16, until the planned shared
    memory -- Q, ``STAGES`` pipelined K and V tiles, P -- fits ``SMEM_BUDGET``."""
    def smem(m: int, n: int) -> int:
        return elt_bytes * (m * block_d + STAGES * 2 * n * block_d + m * n)

    while block_n > 16 and smem(block_m, block_n) > SMEM_BUDGET:
        block_n //= 2
    while shrink_m and block_m > 16 and smem(block_m, block_n) > SMEM_BUDGET:
        block_m //= 2
    return block_m, block_n


def block_d_for(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))  # tl.dot needs K >= 16


def num_warps_for(head_dim: int, elt_bytes: int) -> int:
    """8 warps once a K/V row is 256 bytes or more: with 4, ptxas spills the gathered
    tiles' addresses and the accumulator at 255 registers (checked for sm_90a)."""
    return 8 if block_d_for(head_dim) * elt_bytes >= 256 else 4


def elt_size(q: torch.Tensor, cache: torch.Tensor) -> int:
    return max(q.element_size(), cache.element_size())


def interpreted(t: torch.Tensor) -> bool:
    """Off CUDA, only Triton's interpreter can run these kernels."""
    return t.device.type != "cuda"

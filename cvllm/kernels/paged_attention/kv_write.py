"""The K/V cache write of paged attention (Triton): this step's keys and values stored
at their slots, cast to the cache dtype (FP8: ``clamp(x / scale, +-448)``).

Called by ``attention/backends/triton_backend.py`` where the rotary embedding is not
fused with it (``kernels/rotary.rotary_write_kv`` is, and shares ``to_e4m3_grid``);
reference: ``kernels/reference/paged_attention.write_kv_ref``. ``_write_kv_kernel`` is one
program per token (x a tile of KV heads); slot < 0 (padding) writes nothing, so it can
run over a padded batch. Layout: ``common``.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from cvllm.kernels.paged_attention.checks import (
    check_caches, check_dtypes, check_inner_contiguous, check_same_device, scale_args,
)
from cvllm.kernels.paged_attention.common import FLOAT_DTYPES, INDEX_DTYPES


@triton.jit
def to_e4m3_grid(x):
    """float32 ``x`` saturated at e4m3fn's +-448 (an overflowing cast would be NaN) and
    rounded to nearest-even on the e4m3 grid, in float32, so that the cast that follows
    is exact. Rounding here rather than in the cast keeps the interpreter (whose float8
    cast drops the carry: 1.97 -> 1.0) in step with the GPU and the torch reference.
    Adding then subtracting ``c = 1.5 * 2**(e + 23)`` rounds to multiples of ``2**e``,
    the e4m3 step at |x| (3 mantissa bits, no smaller than 2**-9 for subnormals)."""
    x = tl.minimum(tl.maximum(x, -448.0), 448.0)
    exp = ((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # floor(log2|x|)
    step = tl.maximum(exp, -6) - 3  # log2 of the e4m3 spacing at |x|
    c = ((step + 23 + 127) << 23).to(tl.float32, bitcast=True) * 1.5
    r = (x + c) - c
    return tl.where(x < 0, -tl.abs(r), r)  # a negative that rounds to 0 stays -0, as in torch


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
    num_kv_heads, head_dim, block_size,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcn, stride_kcb, stride_kch, stride_vcn, stride_vcb, stride_vch,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr,
):
    """Token ``t``'s K and V rows of a BLOCK_H tile of KV heads into slot_mapping[t]."""
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    blk, off = slot // block_size, slot % block_size
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h[:, None] < num_kv_heads) & (d[None, :] < head_dim)
    k = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    kc = k_cache_ptr + blk * stride_kcn + off * stride_kcb + h[:, None] * stride_kch + d[None, :]
    vc = v_cache_ptr + blk * stride_vcn + off * stride_vcb + h[:, None] * stride_vch + d[None, :]
    if FP8:
        k = to_e4m3_grid(k.to(tl.float32) / tl.load(k_scale_ptr))
        v = to_e4m3_grid(v.to(tl.float32) / tl.load(v_scale_ptr))
    tl.store(kc, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(vc, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [N, bs, Hkv, D]
    v_cache: torch.Tensor,  # [N, bs, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int32/int64; -1 = padding, nothing written
    k_scale: Optional[torch.Tensor] = None,  # [1] float32: FP8 caches only
    v_scale: Optional[torch.Tensor] = None,  # [1] float32: FP8 caches only
) -> None:
    """Store this step's keys and values at their cache slots (cast to the cache dtype;
    FP8: ``clamp(x / scale, +-448)``). Slots are not range-checked on the device (that
    would sync). Reference: ``write_kv_ref``."""
    check_caches(k_cache, v_cache)
    ks, vs, fp8 = scale_args(k_cache, k_scale, v_scale)
    if k.dim() != 3 or v.shape != k.shape or tuple(k.shape[1:]) != tuple(k_cache.shape[2:]):
        raise ValueError(f"k {tuple(k.shape)} / v {tuple(v.shape)} must be [T, Hkv, D] "
                         f"matching the cache {tuple(k_cache.shape)}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != k.shape[0]:
        raise ValueError(f"slot_mapping {tuple(slot_mapping.shape)} must be [T={k.shape[0]}]")
    check_dtypes(k=(k, FLOAT_DTYPES), v=(v, FLOAT_DTYPES),
                  slot_mapping=(slot_mapping, INDEX_DTYPES))
    check_inner_contiguous(k=k, v=v)
    check_same_device(k, v, k_cache, v_cache, slot_mapping)
    T, hkv, d = k.shape
    if T == 0:
        return
    block_d = triton.next_power_of_2(d)
    block_h = min(triton.next_power_of_2(hkv), max(1, 4096 // block_d))
    grid = (T, triton.cdiv(hkv, block_h))
    _write_kv_kernel[grid](
        k, v, k_cache, v_cache, slot_mapping, ks, vs, hkv, d, k_cache.shape[1],
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        *k_cache.stride()[:3], *v_cache.stride()[:3],
        BLOCK_H=block_h, BLOCK_D=block_d, FP8=fp8,
    )

"""Rotary position embedding applied in place to q and k (Triton).

Called by ``layers/rotary.RotaryEmbedding.forward`` on CUDA tensors;
``kernels/reference/rotary.rotary_embedding_ref`` is the plain-torch version and the test oracle
(tests/kernels/test_rotary.py, also run on the CPU under ``TRITON_INTERPRET=1``). Nothing
here keeps state; the cos/sin cache is owned by the rotary layer.

One program per token rotates every q head, then every k head, from one read of that
token's cos/sin row. q ``[T, H*D]`` (or ``[T, H, D]``) and k ``[T, Hkv*D]`` may be strided
views of the fused QKV projection: only unit stride along ``D`` is needed, so nothing is
copied and the rotated values land in the projection's buffer. Only the first
``rot_dim`` of each head's ``D`` dims rotate (partial rotary); the rest are not touched.

Numerics follow Hugging Face: cos and sin are rounded to the activations' dtype first
(HF casts them before rotating); the rotation itself is float32, rounded once.
Positions are not bounds-checked on the device (that would need a sync): the caller
sizes the cache to ``max_model_len``.

``rotary_write_kv`` is the same rotation fused with the paged KV-cache write
(``paged_attention/kv_write.write_kv``) for the Triton attention backend: one launch
instead of two per layer, which matters at batch 1 where each is a few microseconds of mostly fixed
cost. It rotates q and k in place exactly as ``rotary_embedding`` does, then stores the
rotated k and the v row at the token's cache slot as ``write_kv`` would, so the results
are bit-equal to the two kernels (tested). On Hopper it is launched with PDL and waits
for the QKV projection first thing (``kernels/pdl.py``).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from cvllm.kernels import pdl
from cvllm.kernels.paged_attention.checks import (
    check_caches, check_dtypes, check_same_device, scale_args,
)
from cvllm.kernels.paged_attention.kv_write import to_e4m3_grid
from cvllm.kernels.pdl import gdc_enter

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _rotate_tile(rows, offs1, offs2, mask, cos, sin):
    """Rotate the pairs (offs1, offs2) of a tile of head rows in place; returns the
    rotated halves in the activations' dtype. Each thread loads and stores the same
    elements, so the in-place update races with nothing."""
    x1 = tl.load(rows + offs1[None, :], mask=mask, other=0.0)
    x2 = tl.load(rows + offs2[None, :], mask=mask, other=0.0)
    dtype = x1.dtype
    x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
    o1 = (x1 * cos - x2 * sin).to(dtype)
    o2 = (x2 * cos + x1 * sin).to(dtype)
    tl.store(rows + offs1[None, :], o1, mask=mask)
    tl.store(rows + offs2[None, :], o2, mask=mask)
    return o1, o2


@triton.jit
def _rotate_heads(base_ptr, stride_h, num_heads, cos, sin, offs1, offs2, dmask,
                  BLOCK_H: tl.constexpr):
    """Rotate the pairs (offs1, offs2) of heads 0..num_heads-1 at ``base_ptr``."""
    for h0 in range(0, num_heads, BLOCK_H):
        heads = h0 + tl.arange(0, BLOCK_H)
        mask = (heads < num_heads)[:, None] & dmask[None, :]
        _rotate_tile(base_ptr + heads[:, None].to(tl.int64) * stride_h, offs1, offs2, mask,
                     cos, sin)


@triton.jit
def _angles(cos_sin_ptr, pos_ptr, t, stride_cache, half, act_dtype: tl.constexpr,
            IS_NEOX: tl.constexpr, BLOCK_D: tl.constexpr):
    """Token ``t``'s ``(cos, sin, offs1, offs2, dmask)``: the cache row is ``cos[0:half]
    | sin[0:half]``, rounded to the activations' dtype; neox pairs dim ``i`` with ``i +
    half``, GPT-J pairs ``2i`` with ``2i + 1``."""
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    dmask = d < half
    row = cos_sin_ptr + pos * stride_cache
    cos = tl.load(row + d, mask=dmask, other=0.0).to(act_dtype).to(tl.float32)[None, :]
    sin = tl.load(row + half + d, mask=dmask, other=0.0).to(act_dtype).to(tl.float32)[None, :]
    if IS_NEOX:
        offs1 = d
        offs2 = d + half
    else:
        offs1 = 2 * d
        offs2 = 2 * d + 1
    return cos, sin, offs1, offs2, dmask


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, cos_sin_ptr, pos_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cache,
    num_q_heads, num_k_heads, half,
    IS_NEOX: tl.constexpr, HAS_KEY: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Token ``pid``: rotate q (and k) by the angles of ``positions[pid]``."""
    t = tl.program_id(0).to(tl.int64)
    cos, sin, offs1, offs2, dmask = _angles(cos_sin_ptr, pos_ptr, t, stride_cache, half,
                                            q_ptr.dtype.element_ty, IS_NEOX, BLOCK_D)
    _rotate_heads(q_ptr + t * stride_qt, stride_qh, num_q_heads, cos, sin, offs1, offs2, dmask,
                  BLOCK_H)
    if HAS_KEY:
        _rotate_heads(k_ptr + t * stride_kt, stride_kh, num_k_heads, cos, sin, offs1, offs2,
                      dmask, BLOCK_H)


def _block_heads(num_heads: int, block_d: int) -> int:
    """Heads per tile: all of them, up to 4096 elements of ``block_d`` each."""
    return max(1, min(triton.next_power_of_2(num_heads), 4096 // block_d))


def _head_strides(name: str, x: torch.Tensor, num_tokens: int, head_size: int):
    """``(num_heads, stride_token, stride_head)`` of ``[T, heads*D]`` or ``[T, heads, D]``."""
    if x.dim() == 2 and x.shape[0] == num_tokens and x.shape[1] % head_size == 0:
        if x.stride(1) != 1:
            raise ValueError(f"{name} needs unit stride along the head dim")
        return x.shape[1] // head_size, x.stride(0), head_size
    if x.dim() == 3 and x.shape[0] == num_tokens and x.shape[2] == head_size:
        if x.stride(2) != 1:
            raise ValueError(f"{name} needs unit stride along the head dim")
        return x.shape[1], x.stride(0), x.stride(1)
    raise ValueError(f"{name} must be [T={num_tokens}, heads*{head_size}] or "
                     f"[T, heads, {head_size}]; got {tuple(x.shape)}")


def _check_inputs(positions, query, key, cos_sin_cache, head_size) -> None:
    """Dtypes and devices the kernel relies on; raises ValueError (shapes: _head_strides)."""
    if positions.dim() != 1 or positions.dtype not in (torch.int32, torch.int64) or (
            positions.numel() and positions.stride(0) != 1):
        raise ValueError(f"positions must be contiguous [T] int32/int64; got "
                         f"{tuple(positions.shape)} {positions.dtype}")
    rot_dim = cos_sin_cache.shape[-1]
    if (cos_sin_cache.dim() != 2 or cos_sin_cache.dtype != torch.float32 or rot_dim % 2
            or rot_dim > head_size or cos_sin_cache.stride(1) != 1):
        raise ValueError(f"cos_sin_cache must be [max_pos, rot_dim <= {head_size}] float32 with "
                         f"unit stride, rot_dim even; got {tuple(cos_sin_cache.shape)} "
                         f"{cos_sin_cache.dtype}")
    if query.dtype not in _DTYPES or (key is not None and key.dtype != query.dtype):
        raise ValueError(f"query/key must share one of {_DTYPES}; got {query.dtype}, "
                         f"{None if key is None else key.dtype}")
    tensors = [positions, query, cos_sin_cache] + ([key] if key is not None else [])
    if len({t.device for t in tensors}) != 1:
        raise ValueError(f"rotary inputs must be on one device; got {[t.device for t in tensors]}")


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: Optional[torch.Tensor],
    cos_sin_cache: torch.Tensor,
    head_size: int,
    is_neox_style: bool = True,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Rotate ``query`` / ``key`` IN PLACE at ``positions [T]`` and return them; the
    contract of ``reference.rotary_embedding_ref`` (which returns new tensors).
    ``cos_sin_cache [max_pos, rot_dim]`` float32, cos half then sin half."""
    _check_inputs(positions, query, key, cos_sin_cache, head_size)
    num_tokens = positions.shape[0]
    hq, sqt, sqh = _head_strides("query", query, num_tokens, head_size)
    hk, skt, skh = (0, 0, 0) if key is None else _head_strides("key", key, num_tokens, head_size)
    if num_tokens == 0:
        return query, key
    half = cos_sin_cache.shape[-1] // 2
    block_d = triton.next_power_of_2(half)
    block_h = _block_heads(max(hq, hk), block_d)
    _rotary_kernel[(num_tokens,)](
        query, query if key is None else key, cos_sin_cache, positions,
        sqt, sqh, skt, skh, cos_sin_cache.stride(0), hq, hk, half,
        IS_NEOX=is_neox_style, HAS_KEY=key is not None, BLOCK_H=block_h, BLOCK_D=block_d,
        num_warps=4,
    )
    return query, key


@triton.jit
def _cache_store(ptrs, x, mask, scale_ptr, FP8: tl.constexpr):
    """``x`` (activation dtype) into a cache row: cast, or FP8-quantized as ``write_kv``."""
    if FP8:
        x = to_e4m3_grid(x.to(tl.float32) / tl.load(scale_ptr))
    tl.store(ptrs, x.to(ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _rotate_write_heads(k_row, v_row, kc_row, vc_row, stride_kh, stride_vh, stride_kch,
                        stride_vch, num_heads, head_dim, rot_dim, cos, sin, offs1, offs2,
                        dmask, write, k_scale_ptr, v_scale_ptr,
                        BLOCK_H: tl.constexpr, BLOCK_HD: tl.constexpr, FP8: tl.constexpr):
    """Rotate one token's k heads in place (as ``_rotate_heads``) and, where ``write``,
    store them and its v heads at the cache rows ``kc_row`` / ``vc_row``."""
    dd = tl.arange(0, BLOCK_HD)
    for h0 in range(0, num_heads, BLOCK_H):
        heads = (h0 + tl.arange(0, BLOCK_H))[:, None]
        hmask = heads < num_heads
        mask = hmask & dmask[None, :]
        rows = k_row + heads.to(tl.int64) * stride_kh
        o1, o2 = _rotate_tile(rows, offs1, offs2, mask, cos, sin)
        kc = kc_row + heads * stride_kch
        _cache_store(kc + offs1[None, :], o1, mask & write, k_scale_ptr, FP8)
        _cache_store(kc + offs2[None, :], o2, mask & write, k_scale_ptr, FP8)
        # Dims past rot_dim do not rotate: copied as they are (the rotation never
        # touches them, so reading them here races with nothing).
        rest = hmask & ((dd >= rot_dim) & (dd < head_dim))[None, :] & write
        _cache_store(kc + dd[None, :], tl.load(rows + dd[None, :], mask=rest), rest,
                     k_scale_ptr, FP8)
        vmask = hmask & (dd < head_dim)[None, :] & write
        v = tl.load(v_row + heads.to(tl.int64) * stride_vh + dd[None, :], mask=vmask)
        _cache_store(vc_row + heads * stride_vch + dd[None, :], v, vmask, v_scale_ptr, FP8)


@triton.jit
def _rotary_write_kv_kernel(
    q_ptr, k_ptr, v_ptr, cos_sin_ptr, pos_ptr, slot_ptr, k_cache_ptr, v_cache_ptr,
    k_scale_ptr, v_scale_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cache,
    stride_kcn, stride_kcb, stride_kch, stride_vcn, stride_vcb, stride_vch,
    num_q_heads, num_kv_heads, half, head_dim, block_size, num_writes,
    IS_NEOX: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_KH: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_HD: tl.constexpr, FP8: tl.constexpr, PDL: tl.constexpr,
    EARLY: tl.constexpr,
):
    """Token ``pid``: ``_rotary_kernel``'s rotation of q and k, then (``pid <
    num_writes`` and its slot >= 0) ``_write_kv_kernel``'s store of k and v. With PDL,
    the position, its cos/sin row and the slot are read before the wait: the cache is a
    constant, positions and slots are step inputs, copied in before the step's first
    kernel."""
    t = tl.program_id(0).to(tl.int64)
    cos, sin, offs1, offs2, dmask = _angles(cos_sin_ptr, pos_ptr, t, stride_cache, half,
                                            q_ptr.dtype.element_ty, IS_NEOX, BLOCK_D)
    slot = tl.full([], -1, tl.int64)
    if t < num_writes:
        slot = tl.load(slot_ptr + t).to(tl.int64)
    if PDL:  # q, k, v come from the kernel before (the QKV projection)
        gdc_enter(EARLY)
    _rotate_heads(q_ptr + t * stride_qt, stride_qh, num_q_heads, cos, sin, offs1, offs2, dmask,
                  BLOCK_H)
    # Padding rows (slot -1, or past num_writes) write nothing. A [1, 1] tile rather than
    # a scalar: the interpreter cannot combine a scalar condition with a tile mask.
    write = (tl.zeros([1, 1], tl.int64) + slot) >= 0
    slot = tl.maximum(slot, 0)
    blk, off = slot // block_size, slot % block_size
    _rotate_write_heads(
        k_ptr + t * stride_kt, v_ptr + t * stride_vt,
        k_cache_ptr + blk * stride_kcn + off * stride_kcb,
        v_cache_ptr + blk * stride_vcn + off * stride_vcb,
        stride_kh, stride_vh, stride_kch, stride_vch, num_kv_heads, head_dim, 2 * half,
        cos, sin, offs1, offs2, dmask, write, k_scale_ptr, v_scale_ptr,
        BLOCK_H=BLOCK_KH, BLOCK_HD=BLOCK_HD, FP8=FP8)


def _check_write(key, value, k_cache, v_cache, slot_mapping, num_writes, head_size) -> None:
    """What ``rotary_write_kv`` needs beyond ``_check_inputs``: caches that fit k / v,
    ``num_writes`` slots, one device."""
    check_caches(k_cache, v_cache)
    if tuple(k_cache.shape[2:]) != (key.shape[1], head_size):
        raise ValueError(f"the cache {tuple(k_cache.shape)} does not fit k "
                         f"[T, {key.shape[1]}, {head_size}]")
    if value.shape != key.shape or value.dtype != key.dtype or value.stride(2) != 1:
        raise ValueError(f"value {tuple(value.shape)} {value.dtype} must match key "
                         f"{tuple(key.shape)} {key.dtype} with unit stride along the head dim")
    if not 0 <= num_writes <= key.shape[0]:
        raise ValueError(f"num_writes {num_writes} must be in [0, T={key.shape[0]}]")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] < num_writes or (
            num_writes and slot_mapping.stride(0) != 1):
        raise ValueError(f"slot_mapping {tuple(slot_mapping.shape)} must be contiguous 1-D "
                         f"with at least num_writes={num_writes} entries")
    check_dtypes(slot_mapping=(slot_mapping, (torch.int32, torch.int64)))
    check_same_device(key, value, k_cache, v_cache, slot_mapping)


def rotary_write_kv(
    positions: torch.Tensor,  # [T] int32/int64
    query: torch.Tensor,  # [T, H*D] or [T, H, D], unit stride along D
    key: torch.Tensor,  # [T, Hkv*D] or [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv*D] or [T, Hkv, D]
    cos_sin_cache: torch.Tensor,  # [max_pos, rot_dim] float32
    head_size: int,
    is_neox_style: bool,
    k_cache: torch.Tensor,  # [N, bs, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [>= num_writes] int32/int64; -1 = padding
    num_writes: Optional[int] = None,  # tokens 0..num_writes-1 are written (default T)
    k_scale: Optional[torch.Tensor] = None,  # [1] float32: FP8 caches only
    v_scale: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``rotary_embedding(positions, query, key, ...)`` then ``write_kv(key[:num_writes],
    value[:num_writes], k_cache, v_cache, slot_mapping[:num_writes])``
    in one kernel; returns the rotated ``(query, key)`` (the inputs, in place)."""
    _check_inputs(positions, query, key, cos_sin_cache, head_size)
    T = positions.shape[0]
    num_writes = T if num_writes is None else int(num_writes)
    hq, sqt, sqh = _head_strides("query", query, T, head_size)
    hk, skt, skh = _head_strides("key", key, T, head_size)
    k3 = key.view(T, hk, head_size) if key.dim() == 2 else key  # [T, Hkv, D]
    v3 = value  # [T, Hkv, D]
    if value.dim() == 2 and tuple(value.shape) == (T, hk * head_size) and value.stride(1) == 1:
        v3 = value.view(T, hk, head_size)  # [T, Hkv, D]
    _check_write(k3, v3, k_cache, v_cache, slot_mapping, num_writes, head_size)
    ks, vs, fp8 = scale_args(k_cache, k_scale, v_scale)
    if T == 0:
        return query, key
    half = cos_sin_cache.shape[-1] // 2
    block_d = triton.next_power_of_2(half)
    block_hd = triton.next_power_of_2(head_size)
    _rotary_write_kv_kernel[(T,)](
        query, key, v3, cos_sin_cache, positions, slot_mapping, k_cache, v_cache, ks, vs,
        sqt, sqh, skt, skh, v3.stride(0), v3.stride(1), cos_sin_cache.stride(0),
        *k_cache.stride()[:3], *v_cache.stride()[:3],
        hq, hk, half, head_size, k_cache.shape[1], num_writes,
        IS_NEOX=is_neox_style, BLOCK_H=_block_heads(hq, block_d),
        BLOCK_KH=_block_heads(hk, block_hd),
        BLOCK_D=block_d, BLOCK_HD=block_hd, FP8=fp8, PDL=pdl.enabled(query),
        EARLY=pdl.early_trigger(query, "rope"), num_warps=4, **pdl.launch_args(query),
    )
    return query, key

"""Rotary position embedding applied in place to q and k (Triton).

Called by ``layers/rotary.RotaryEmbedding.forward`` on CUDA tensors;
``kernels/reference.rotary_embedding_ref`` is the plain-torch version and the test oracle
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
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _rotate_heads(base_ptr, stride_h, num_heads, cos, sin, offs1, offs2, dmask,
                  BLOCK_H: tl.constexpr):
    """Rotate the pairs (offs1, offs2) of heads 0..num_heads-1 at ``base_ptr``."""
    for h0 in range(0, num_heads, BLOCK_H):
        heads = h0 + tl.arange(0, BLOCK_H)
        mask = (heads < num_heads)[:, None] & dmask[None, :]
        rows = base_ptr + heads[:, None].to(tl.int64) * stride_h
        x1 = tl.load(rows + offs1[None, :], mask=mask, other=0.0)
        x2 = tl.load(rows + offs2[None, :], mask=mask, other=0.0)
        dtype = x1.dtype
        x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
        tl.store(rows + offs1[None, :], (x1 * cos - x2 * sin).to(dtype), mask=mask)
        tl.store(rows + offs2[None, :], (x2 * cos + x1 * sin).to(dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, cos_sin_ptr, pos_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cache,
    num_q_heads, num_k_heads, half,
    IS_NEOX: tl.constexpr, HAS_KEY: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Token ``pid``: rotate q (and k) by the angles of ``positions[pid]``. The cache row
    is ``cos[0:half] | sin[0:half]``; neox pairs dim ``i`` with ``i + half``, GPT-J
    pairs ``2i`` with ``2i + 1``."""
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    dmask = d < half
    act_dtype = q_ptr.dtype.element_ty
    row = cos_sin_ptr + pos * stride_cache
    cos = tl.load(row + d, mask=dmask, other=0.0).to(act_dtype).to(tl.float32)[None, :]
    sin = tl.load(row + half + d, mask=dmask, other=0.0).to(act_dtype).to(tl.float32)[None, :]
    if IS_NEOX:
        offs1 = d
        offs2 = d + half
    else:
        offs1 = 2 * d
        offs2 = 2 * d + 1
    _rotate_heads(q_ptr + t * stride_qt, stride_qh, num_q_heads, cos, sin, offs1, offs2, dmask,
                  BLOCK_H)
    if HAS_KEY:
        _rotate_heads(k_ptr + t * stride_kt, stride_kh, num_k_heads, cos, sin, offs1, offs2,
                      dmask, BLOCK_H)


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
    if positions.dim() != 1 or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"positions must be [T] int32/int64; got {tuple(positions.shape)} "
                         f"{positions.dtype}")
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
    block_h = max(1, min(triton.next_power_of_2(max(hq, hk)), 4096 // block_d))
    _rotary_kernel[(num_tokens,)](
        query, query if key is None else key, cos_sin_cache, positions,
        sqt, sqh, skt, skh, cos_sin_cache.stride(0), hq, hk, half,
        IS_NEOX=is_neox_style, HAS_KEY=key is not None, BLOCK_H=block_h, BLOCK_D=block_d,
        num_warps=4,
    )
    return query, key

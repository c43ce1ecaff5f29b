"""References of ``kernels/rotary.py``: the rotary embedding, and the same fused with
the paged K/V write."""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from cvllm.kernels.reference.paged_attention import write_kv_ref


def rotary_embedding_ref(
    positions: torch.Tensor,  # [T]
    query: torch.Tensor,  # [T, H*D] or [T, H, D]
    key: Optional[torch.Tensor],  # [T, Hkv*D] or [T, Hkv, D]
    cos_sin_cache: torch.Tensor,  # [max_pos, rot_dim] float32: cos half | sin half
    head_size: int,
    is_neox_style: bool = True,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Rotated copies of query / key (inputs untouched), in their dtype, with cos/sin cast
    to it first, as HF and ``layers/rotary.py`` do. The first ``rot_dim`` dims of each
    head rotate: neox pairs (i, i + rot_dim/2), GPT-J (2i, 2i+1). Oracle of
    ``kernels/rotary.py``."""
    rot_dim = cos_sin_cache.shape[-1]
    cos, sin = cos_sin_cache.index_select(0, positions.long()).chunk(2, dim=-1)  # [T, rot/2]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        heads = x.reshape(x.shape[0], -1, head_size)  # [T, heads, D]
        rot, rest = heads[..., :rot_dim], heads[..., rot_dim:]
        c, s = cos.unsqueeze(1).to(x.dtype), sin.unsqueeze(1).to(x.dtype)  # [T, 1, rot/2]
        if is_neox_style:
            x1, x2 = rot.chunk(2, dim=-1)
        else:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
        o1, o2 = x1 * c - x2 * s, x2 * c + x1 * s
        if is_neox_style:
            rot = torch.cat([o1, o2], dim=-1)
        else:
            rot = torch.stack([o1, o2], dim=-1).flatten(-2)  # [T, heads, rot_dim]
        return torch.cat([rot, rest], dim=-1).reshape(x.shape)

    return rotate(query), (rotate(key) if key is not None else None)


def rotary_write_kv_ref(
    positions: torch.Tensor,  # [T]
    query: torch.Tensor,  # [T, H*D] or [T, H, D]
    key: torch.Tensor,  # [T, Hkv*D] or [T, Hkv, D]
    value: torch.Tensor,  # same shape as key
    cos_sin_cache: torch.Tensor,  # [max_pos, rot_dim] float32
    head_size: int,
    is_neox_style: bool,
    k_cache: torch.Tensor,  # [N, bs, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [>= num_writes] int; -1 writes nothing
    num_writes: Optional[int] = None,
    k_scale: Optional[torch.Tensor] = None,
    v_scale: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Rotated copies of query / key (``rotary_embedding_ref``), with the rotated keys
    and the values of tokens ``0..num_writes-1`` written to the caches (``write_kv_ref``).
    Oracle of ``kernels/rotary.rotary_write_kv``."""
    q, k = rotary_embedding_ref(positions, query, key, cos_sin_cache, head_size, is_neox_style)
    n = positions.shape[0] if num_writes is None else num_writes
    T = positions.shape[0]
    k3, v3 = k.reshape(T, -1, head_size), value.reshape(T, -1, head_size)  # [T, Hkv, D]
    write_kv_ref(k3[:n], v3[:n], k_cache, v_cache, slot_mapping[:n], k_scale, v_scale)
    return q, k

"""Attention layer: the model-facing wrapper around the selected attention backend.

Built by the model classes, one per decoder layer; it holds no cache. Each forward gets
that layer's ``(k_cache, v_cache)`` (owned by the worker, passed through
``model.forward(..., kv_caches)``) and the step's ``AttentionMetadata``, of which it uses
the view of its KV cache group (``attn_metadata.view(self.sliding_window)``): layers with
a sliding window live in their window's group, whose out-of-window blocks get freed.

Given the layer's rotary embedding and the positions, it rotates q and k itself, or,
when the backend says it ``fuses_rope`` (the Triton backend), hands it the rotation as
``RopeInputs`` so that one kernel rotates q and k and writes the K/V cache.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
from torch import nn

from cvllm.attention.backend import get_attn_backend
from cvllm.attention.kv_cache import KVCache
from cvllm.attention.metadata import AttentionMetadata

if TYPE_CHECKING:
    from cvllm.layers.rotary import RotaryEmbedding


class Attention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: Optional[int] = None,
        sliding_window: Optional[int] = None,
        logits_soft_cap: Optional[float] = None,
        prefix: str = "",
    ):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads or num_heads
        if num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )
        self.head_size = head_size
        self.scale = float(scale)
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        self.prefix = prefix
        self.backend = get_attn_backend()

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: KVCache,
        attn_metadata: AttentionMetadata,
        positions: Optional[torch.Tensor] = None,
        rotary_emb: Optional["RotaryEmbedding"] = None,
    ) -> torch.Tensor:
        """``query [T, H*D]``, ``key``/``value [T, Hkv*D]`` -> ``[T, H*D]``. With
        ``rotary_emb``, q and k (fresh projections, rotated in place) are first rotated at
        ``positions [T]``: by the backend together with its K/V write where it can
        (``fuses_rope``), else here."""
        rope = None
        if rotary_emb is not None:
            if positions is None:
                raise ValueError(f"{self.prefix or 'attention'}: rotary_emb needs positions")
            if getattr(self.backend, "fuses_rope", False):
                rope = rotary_emb.rope_inputs(positions)
            else:
                query, key = rotary_emb(positions, query, key)
        T = query.shape[0]
        q = query.reshape(T, self.num_heads, self.head_size)  # [T, H, D]
        k = key.reshape(T, self.num_kv_heads, self.head_size)  # [T, Hkv, D]
        v = value.reshape(T, self.num_kv_heads, self.head_size)  # [T, Hkv, D]
        k_cache, v_cache = kv_cache
        out = self.backend.forward(
            q,
            k,
            v,
            k_cache,
            v_cache,
            attn_metadata.view(self.sliding_window),  # this layer's KV cache group
            self.scale,
            self.sliding_window,
            self.logits_soft_cap,
            **({"rope": rope} if rope is not None else {}),
        )  # [T, H, D]
        return out.reshape(T, self.num_heads * self.head_size)

    def extra_repr(self) -> str:
        return (
            f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_size={self.head_size}, "
            f"scale={self.scale:.4g}, sliding_window={self.sliding_window}, "
            f"backend={self.backend.name}"
        )

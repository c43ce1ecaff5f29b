"""Attention layer: the model-facing wrapper around the selected attention backend.

Built by the model classes, one per decoder layer; it holds no cache. Each forward gets
that layer's ``(k_cache, v_cache)`` (owned by the worker, passed through
``model.forward(..., kv_caches)``) and the step's ``AttentionMetadata``, of which it uses
the view of its KV cache group (``attn_metadata.view(self.sliding_window)``): layers with
a sliding window live in their window's group, whose out-of-window blocks get freed.

Given the layer's rotary embedding and the positions, it rotates q and k itself, or,
when the backend says it ``fuses_rope`` (the Triton backend), hands it the rotation as
``RopeInputs`` so that one kernel rotates q and k and writes the K/V cache.

``split_at_attention(hook)``: while it is active, every ``Attention.forward`` call goes to
``hook(layer, query, key, value, kv_cache, attn_metadata, positions, rotary_emb)``
instead, which returns the ``[T, H*D]`` output. ``worker/mixed_graph.py`` uses it to
capture a step's forward as CUDA-graph pieces with the attention left out between them;
the attention it then runs itself, through ``attend``.
"""

from __future__ import annotations

import contextlib
import threading
from typing import TYPE_CHECKING, Callable, Iterator, Optional

import torch
from torch import nn

from cvllm.attention.backend import get_attn_backend
from cvllm.attention.kv_cache import KVCache
from cvllm.attention.metadata import AttentionMetadata

if TYPE_CHECKING:
    from cvllm.layers.rotary import RotaryEmbedding


AttentionHook = Callable[..., torch.Tensor]
_HOOK = threading.local()  # .hook: this thread's active split_at_attention hook


@contextlib.contextmanager
def split_at_attention(hook: AttentionHook) -> Iterator[None]:
    """Within, on this thread: ``Attention.forward`` calls ``hook`` instead of attending
    (see the module docstring). Not nested. Per thread: under ``--multithread`` every rank
    is a thread of one process running its own model, and one thread's hook must not
    divert another thread's forward."""
    if getattr(_HOOK, "hook", None) is not None:
        raise RuntimeError("split_at_attention is already active")
    _HOOK.hook = hook
    try:
        yield
    finally:
        _HOOK.hook = None


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
        """``query [T, H*D]``, ``key``/``value [T, Hkv*D]`` -> ``[T, H*D]`` (``attend``),
        or whatever the active ``split_at_attention`` hook returns."""
        hook = getattr(_HOOK, "hook", None)
        if hook is not None:
            return hook(self, query, key, value, kv_cache, attn_metadata, positions, rotary_emb)
        return self.attend(query, key, value, kv_cache, attn_metadata, positions, rotary_emb)

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: KVCache,
        attn_metadata: AttentionMetadata,
        positions: Optional[torch.Tensor] = None,
        rotary_emb: Optional["RotaryEmbedding"] = None,
        out: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """``query [T, H*D]``, ``key``/``value [T, Hkv*D]`` -> ``[T, H*D]``. With
        ``rotary_emb``, q and k (fresh projections, rotated in place) are first rotated at
        ``positions [T]``: by the backend together with its K/V write where it can
        (``fuses_rope``), else here. ``out [T, H*D]`` (contiguous): written and returned
        instead of a new tensor, for a backend that takes ``out`` (``takes_out``)."""
        if out is not None and not getattr(self.backend, "takes_out", False):
            raise ValueError(f"attention backend {self.backend.name} takes no out tensor")
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
            **({"out": out.view(T, self.num_heads, self.head_size)} if out is not None else {}),
        )  # [T, H, D]
        return out.reshape(T, self.num_heads * self.head_size)

    def extra_repr(self) -> str:
        return (
            f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_size={self.head_size}, "
            f"scale={self.scale:.4g}, sliding_window={self.sliding_window}, "
            f"backend={self.backend.name}"
        )

"""Attention layer: the model-facing wrapper around its attention backend.

Built by the model classes, one per decoder layer, with the backend named by
``ModelConfig.attention_backend`` (``attention/backend.py`` turns the name into the
backend; the engine resolves it once for the device); it holds no cache. Each forward
gets that layer's ``KVCache`` (owned by the worker, passed through
``model.forward(..., kv_caches)``) and the step's ``AttentionMetadata``, of which it uses
the view of its KV cache group (``attn_metadata.view(self.sliding_window)``): layers with
a sliding window live in their window's group, whose out-of-window blocks get freed.

Given the layer's rotary embedding and the positions, it rotates q and k itself, or,
when the backend declares ``fused_rope`` (the Triton backend), hands it the rotation as
``RopeInputs`` so that one kernel rotates q and k and writes the K/V cache. The
backend's capabilities are read once, here at construction, never probed per call.

``split_at_attention(model, hook)``: while it is active, every ``Attention.forward`` call
of that model goes to ``hook(layer, query, key, value, kv_cache, attn_metadata,
positions, rotary_emb)`` instead, which returns the ``[T, H*D]`` output.
``worker/mixed_graph.py`` uses it to capture a step's forward as CUDA-graph pieces with
the attention left out between them; the attention it then runs itself, through
``attend``. The hook is set on the model's own layers: under ``--multithread`` every rank
is a thread of one process running its own model, and one rank's capture must not divert
another's forward.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Callable, Iterator, Optional, Union

import torch
from torch import nn

from cvllm.attention.backend import get_attn_backend
from cvllm.attention.interface import AttentionBackend, AttentionParams
from cvllm.attention.kv_cache import KVCache
from cvllm.attention.metadata import AttentionMetadata

if TYPE_CHECKING:
    from cvllm.layers.rotary import RotaryEmbedding


AttentionHook = Callable[..., torch.Tensor]


@contextlib.contextmanager
def split_at_attention(model: nn.Module, hook: AttentionHook) -> Iterator[None]:
    """Within: every ``Attention.forward`` of ``model`` calls ``hook`` instead of
    attending (see the module docstring). Not nested on one model; other models (other
    ranks' threads) are untouched."""
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    if any(a.split_hook is not None for a in layers):
        raise RuntimeError("split_at_attention is already active on this model")
    for a in layers:
        a.split_hook = hook
    try:
        yield
    finally:
        for a in layers:
            a.split_hook = None


def require_capabilities(model: nn.Module, *features: str) -> None:
    """Check at start-up that every attention layer's backend in ``model`` declares
    ``features`` (``AttentionCapabilities`` fields); NotImplementedError otherwise."""
    for backend in {id(m.backend): m.backend for m in model.modules()
                    if isinstance(m, Attention)}.values():
        backend.require(*features)


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
        backend: Union[str, AttentionBackend] = "auto",
        causal: bool = True,
    ):
        """``backend``: a name (``ModelConfig.attention_backend``; ``auto`` follows torch's
        default device) or a backend itself; ``causal`` False: encoder attention, where
        the backend declares ``non_causal``."""
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
        self.params = AttentionParams(self.scale, sliding_window, logits_soft_cap, causal)
        self.backend = get_attn_backend(backend) if isinstance(backend, str) else backend
        self.backend.check_layer(self.params)
        self.fused_rope = self.backend.capabilities.fused_rope
        """The backend rotates q and k with its K/V write (read once: no per-call probe)."""
        self.split_hook: Optional[AttentionHook] = None
        """Set by ``split_at_attention`` on this model's layers only."""

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: KVCache, attn_metadata: AttentionMetadata,
                positions: Optional[torch.Tensor] = None,
                rotary_emb: Optional["RotaryEmbedding"] = None) -> torch.Tensor:
        """``query [T, H*D]``, ``key``/``value [T, Hkv*D]`` -> ``[T, H*D]`` (``attend``),
        or whatever the active ``split_at_attention`` hook returns."""
        hook = self.split_hook
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
        (``fused_rope``), else here. ``out [T, H*D]`` (contiguous): written and returned
        instead of a new tensor, for a backend that declares ``takes_out``."""
        T = query.shape[0]
        if out is not None:
            if not self.backend.capabilities.takes_out:
                raise ValueError(f"attention backend {self.backend.name} takes no out tensor")
            out = out.view(T, self.num_heads, self.head_size)  # [T, H, D]
        rope = None
        if rotary_emb is not None:
            if positions is None:
                raise ValueError(f"{self.prefix or 'attention'}: rotary_emb needs positions")
            if self.fused_rope:
                rope = rotary_emb.rope_inputs(positions)
            else:
                query, key = rotary_emb(positions, query, key)
        q = query.reshape(T, self.num_heads, self.head_size)  # [T, H, D]
        k = key.reshape(T, self.num_kv_heads, self.head_size)  # [T, Hkv, D]
        v = value.reshape(T, self.num_kv_heads, self.head_size)  # [T, Hkv, D]
        out = self.backend.forward(
            q, k, v, kv_cache,
            attn_metadata.view(self.sliding_window),  # this layer's KV cache group
            self.params, rope, out,
        )  # [T, H, D]
        return out.reshape(T, self.num_heads * self.head_size)

    def extra_repr(self) -> str:
        return (
            f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_size={self.head_size}, "
            f"scale={self.scale:.4g}, sliding_window={self.sliding_window}, "
            f"backend={self.backend.name}"
        )

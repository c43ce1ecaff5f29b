"""What each decoder layer keeps between steps: the per-layer cache specs.

A model class declares them with ``cache_specs() -> list[LayerCacheSpec]`` (one entry per
layer, in layer order, with this rank's KV heads). For a model without the method the
worker derives them from its ``layers.attention.Attention`` modules when there is one per
layer (``SlidingWindowSpec`` where the layer has a window), else ``FullAttentionSpec``
for every layer from the config. The worker groups layers into KV cache groups and
allocates ``kv_caches[i]`` from ``specs[i]`` (``attention/kv_cache.py``); the scheduler
sizes block pools and state slots from them. What ``kv_caches[i]`` holds:

- ``FullAttentionSpec`` / ``SlidingWindowSpec``: ``(k_cache, v_cache)``, each
  ``[num_blocks, block_size, Hkv, D]``, addressed through block tables.
- ``MLASpec``: ``(kv_cache, None)`` with ``kv_cache [num_blocks, block_size,
  kv_lora_rank + qk_rope_head_dim]``: the compressed latent and the rope key, per token.
- ``StateSpec``: a tuple of tensors ``[num_state_slots, *shape]`` (e.g. a conv state and
  a recurrent state), one slot per running sequence, addressed by
  ``attn_metadata.state_slots [B]``; ``num_state_slots`` = ``max_num_seqs``. The worker
  zeroes a sequence's slot before a step in which ``attn_metadata.has_initial_state`` is
  False for it (its first chunk, also after preemption), so the layer may read it.

Full and MLA layers share KV cache group "None" (``attn_metadata.view(None)``); sliding
layers share the group of their window (``attn_metadata.view(window)``).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Optional, Tuple, Union

import torch


class TokenCacheSpec(abc.ABC):
    """A layer that caches a fixed number of bytes per token in paged blocks (the
    attention layers); its ``sliding_window`` names its KV cache group."""

    @property
    def sliding_window(self) -> Optional[int]:
        """Tokens a query attends back to; None: the whole context."""
        return None

    @abc.abstractmethod
    def bytes_per_token(self) -> int: ...


@dataclass(frozen=True)
class PagedKVSpec(TokenCacheSpec):
    """What the K/V layers have in common: a K and a V cache of ``num_kv_heads`` heads of
    ``head_dim`` per token (never built itself: one of the two below)."""

    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def bytes_per_token(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim * _itemsize(self.dtype)


@dataclass(frozen=True)
class FullAttentionSpec(PagedKVSpec):
    """Every query attends over its whole context."""


@dataclass(frozen=True)
class SlidingWindowSpec(PagedKVSpec):
    window: int
    """Tokens a query attends back to (HF ``sliding_window``); older blocks can be freed."""

    @property
    def sliding_window(self) -> Optional[int]:
        return self.window


@dataclass(frozen=True)
class MLASpec(TokenCacheSpec):
    kv_lora_rank: int
    qk_rope_head_dim: int
    dtype: torch.dtype

    def bytes_per_token(self) -> int:
        return (self.kv_lora_rank + self.qk_rope_head_dim) * _itemsize(self.dtype)


@dataclass(frozen=True)
class StateSpec:
    shapes: Tuple[Tuple[int, ...], ...]
    """Shape of each state tensor of one sequence (e.g. conv state, recurrent state)."""
    dtypes: Tuple[torch.dtype, ...]

    def bytes_per_slot(self) -> int:
        total = 0
        for shape, dt in zip(self.shapes, self.dtypes):
            n = 1
            for s in shape:
                n *= s
            total += n * _itemsize(dt)
        return total


LayerCacheSpec = Union[FullAttentionSpec, SlidingWindowSpec, MLASpec, StateSpec]


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()

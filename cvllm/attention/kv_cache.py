"""Paged KV cache: its per-block size (``KVCacheSpec``) and its allocation.

The worker (``ModelRunner``, every rank) builds the spec from the model config, sizes the
cache in blocks, and owns the tensors ``allocate_kv_cache`` returns for the life of the
engine; each step it passes them to ``model.forward`` (one ``(k_cache, v_cache)`` per
layer). The block manager on rank 0 hands out block ids into them; the attention
backends write and read them through ``AttentionMetadata.slot_mapping`` / ``block_tables``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

import torch

KVCache = Tuple[torch.Tensor, torch.Tensor]
"""One layer's ``(k_cache, v_cache)``, each ``[num_blocks, block_size, Hkv, D]``."""


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    """KV heads held by this rank (after TP sharding / replication)."""
    head_dim: int
    block_size: int
    """Tokens per block."""
    dtype: torch.dtype

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"KVCacheSpec.{name} must be >= 1, got {getattr(self, name)}")

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block id costs across all layers, K and V."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem

    def num_blocks_for_bytes(self, nbytes: int) -> int:
        return max(int(nbytes) // self.bytes_per_block, 0)


def allocate_kv_cache(
    spec: KVCacheSpec, num_blocks: int, device: torch.device | str
) -> List[KVCache]:
    """Zeroed caches: never-written slots are read (then masked) by the reference backend,
    and a masked NaN would still poison ``softmax @ V``."""
    if num_blocks < 1:
        raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
    shape = (num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)  # [N, bs, Hkv, D]
    return [
        (
            torch.zeros(shape, dtype=spec.dtype, device=device),
            torch.zeros(shape, dtype=spec.dtype, device=device),
        )
        for _ in range(spec.num_layers)
    ]

"""The per-layer caches: how they group, how big each group is, and their allocation.

The worker (``ModelRunner``, every rank) takes the model's per-layer ``cache_specs()``
(``attention/specs.py``), sizes the caches with ``plan_kv_cache`` into a
``KVCacheLayout`` (``core/kv_cache_manager.py``: groups, blocks per group, state slots)
and owns the tensors ``allocate_kv_caches`` returns for the life of the engine; each step
it passes them to ``model.forward`` (``kv_caches[i]`` for layer i, see specs.py for what
each kind holds). Rank 0's block managers hand out block ids into them per group; the
attention backends write and read them through ``AttentionMetadata.view(window)``.

Budget split between groups (``plan_kv_cache``): the state slots (``max_num_seqs`` of
them) are taken first. The rest goes to the block groups so that every group gets the
same number of blocks N (each group's share is N x its bytes per block, i.e.
proportional to bytes per token x layers), except that a sliding group is capped at the
most blocks it can ever use at once, ``max_num_seqs x (ceil((W-1)/bs) + 2) +
ceil(max_num_batched_tokens/bs)`` (each sequence keeps at most ``ceil((W-1+n)/bs) + 1``
blocks given ``n`` new tokens); what a capped group leaves goes to the others. Equal
counts keep a sliding group from ever being the tighter one: a sequence never needs
more blocks in a sliding group than in a full one.

``KVCacheSpec`` / ``allocate_kv_cache`` are the uniform (all full-attention) special
case, kept for tests and tools that build one pool by hand.

A full or sliding layer's cache is a ``KVCache``: its K and V tensors and, for an FP8
cache, their scales. The worker owns one per layer; models pass it, as one object, from
``kv_caches[i]`` to their attention layer, which hands it to the backend.

FP8 KV cache (``--fp8-kvcache``): ``fp8_kv_specs`` turns the full and sliding specs'
dtype into ``torch.float8_e4m3fn`` before sizing, so bytes per block halve against
bf16 and the same budget holds twice the blocks; MLA latents and linear-attention states
stay in the model dtype. Every FP8 ``KVCache`` carries its scales, ``k_scale`` and
``v_scale``: ``[1]`` float32 tensors on the cache's device, one per layer for K and one
for V, which the backends hand to the kernels.

Scale choice: per layer and per tensor, calibrated once from the first real write --
``2 x max|x| / 448`` of the first prefill's K (or V) of that layer, a factor-2 margin for
later tokens; anything beyond saturates at +-448 rather than overflowing to NaN.
A fixed 1.0 (vLLM's default without checkpoint scales) was measured coarser: in
SmolLM2-135M (bf16), 41% of layer 0's V values lie below e4m3's smallest normal (2**-6),
and teacher-forced greedy tokens matched the bf16 cache's 94.2% of the time, against
97.4% with the calibrated scale (tests/engine/test_fp8_kvcache.py). The
calibration (``calibrate_kv_scales``, called by both backends before a write) runs on
the device with no host sync and rewrites the ``[1]`` tensors in place, so kernel
arguments and CUDA graph pointers stay valid; it runs while the cache's
``scales_pending`` is set: from allocation, and again after the worker's CUDA graph
warm-up and capture (``reset_kv_scales``), whose dummy inputs must not fix the scales.
The first real step holds prompt tokens, so it runs eagerly and calibrates.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch

from cvllm.attention.specs import (
    FullAttentionSpec,
    LayerCacheSpec,
    MLASpec,
    SlidingWindowSpec,
    StateSpec,
)
from cvllm.config import ConfigError
from cvllm.core.block_manager import cdiv, max_live_blocks
from cvllm.core.kv_cache_manager import KVCacheGroupConfig, KVCacheLayout
from cvllm.kernels.reference.paged_attention import FP8_E4M3_MAX, FP8_KV_DTYPE

FP8_KV_SCALE = 1.0
"""Scale of an FP8 cache before its calibration: cached = clamp(x / scale, +-448)."""
FP8_KV_MARGIN = 2.0
"""Headroom of the calibrated scale over the first write's max |x|."""


@dataclass(eq=False)
class KVCache:
    """One full or sliding attention layer's paged cache (allocated by the worker, owned
    by it for the engine's life; the model passes it to the layer each step)."""

    k: torch.Tensor  # [N, bs, Hkv, D]
    v: torch.Tensor  # [N, bs, Hkv, D]
    k_scale: Optional[torch.Tensor] = None
    """FP8 only: ``[1]`` float32 on the cache's device; cached = clamp(k / k_scale, +-448)."""
    v_scale: Optional[torch.Tensor] = None
    scales_pending: bool = False
    """FP8 only: the next write of real tokens calibrates the scales (module docstring)."""

    def __post_init__(self) -> None:
        fp8 = self.k.dtype == FP8_KV_DTYPE or self.v.dtype == FP8_KV_DTYPE
        if fp8 != (self.k_scale is not None) or fp8 != (self.v_scale is not None):
            raise ValueError("a KV cache has scales exactly when it is FP8: build an FP8 "
                             "one with KVCache.fp8 (or attention/kv_cache.py's allocation)")

    @classmethod
    def fp8(cls, k: torch.Tensor, v: torch.Tensor) -> "KVCache":
        """A fresh FP8 cache: scales ``FP8_KV_SCALE``, calibrated at its first write."""
        def scale() -> torch.Tensor:
            return torch.full((1,), FP8_KV_SCALE, dtype=torch.float32, device=k.device)
        return cls(k, v, scale(), scale(), scales_pending=True)

    def __iter__(self) -> Iterator[torch.Tensor]:
        """K then V: for code that walks every layer's tensors alike (block copies, sizes)."""
        return iter((self.k, self.v))


LayerCache = Union[KVCache, Tuple[Optional[torch.Tensor], ...]]
"""Any layer's cache: a ``KVCache``, MLA's ``(kv, None)`` or a state layer's tensors."""


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
    return [_zeros_kv_cache(shape, spec.dtype, device) for _ in range(spec.num_layers)]


def _zeros_kv_cache(shape, dtype: torch.dtype, device) -> KVCache:
    """A zeroed K/V cache; an FP8 one gets its scales (module docstring)."""
    k = torch.zeros(shape, dtype=dtype, device=device)  # [N, bs, Hkv, D]
    v = torch.zeros(shape, dtype=dtype, device=device)
    return KVCache.fp8(k, v) if dtype == FP8_KV_DTYPE else KVCache(k, v)


def calibrate_kv_scales(cache: KVCache, k: torch.Tensor, v: torch.Tensor) -> None:
    """Before the first write of real tokens ``k``, ``v [T, Hkv, D]`` into an FP8
    ``cache`` (``scales_pending``): set each scale to ``FP8_KV_MARGIN * max|x| / 448``
    (1.0 when x is all zero), in place, without a host sync. A no-op once calibrated and
    for a write of no tokens."""
    if not cache.scales_pending or k.numel() == 0:
        return
    for x, scale in ((k, cache.k_scale), (v, cache.v_scale)):
        amax = x.detach().abs().amax().float()
        scale.copy_(torch.where(amax > 0, amax * (FP8_KV_MARGIN / FP8_E4M3_MAX),
                                torch.ones_like(amax)).reshape(1))
    cache.scales_pending = False


def reset_kv_scales(caches: Sequence[LayerCache]) -> None:
    """Make every FP8 cache recalibrate on its next write (after dummy warm-up steps)."""
    for c in caches:
        if isinstance(c, KVCache) and c.k_scale is not None:
            c.scales_pending = True


def fp8_kv_specs(specs: Sequence[LayerCacheSpec]) -> List[LayerCacheSpec]:
    """``specs`` with the K/V caches of full and sliding layers in FP8 e4m3; MLA latents
    and state layers keep their dtype (their kernels read them in the model dtype)."""
    return [dataclasses.replace(s, dtype=FP8_KV_DTYPE)
            if isinstance(s, (FullAttentionSpec, SlidingWindowSpec)) else s for s in specs]


# ----- groups and sizing ------------------------------------------------------------------


@dataclass(frozen=True)
class CacheSizing:
    """The scheduler limits that bound what the caches can ever hold."""

    block_size: int
    max_num_seqs: int
    max_model_len: int
    max_num_batched_tokens: int
    max_chunk: int
    """Most new tokens one sequence gets in one step."""


def group_layers(specs: Sequence[LayerCacheSpec]) -> List[Tuple[Optional[int], List[int]]]:
    """``(sliding_window, layer ids)`` per KV cache group: full-attention and MLA layers
    first (window None), then one group per distinct window, ascending. State layers
    belong to no group."""
    by_window: Dict[Optional[int], List[int]] = {}
    for i, spec in enumerate(specs):
        if isinstance(spec, StateSpec):
            continue
        if not isinstance(spec, (FullAttentionSpec, SlidingWindowSpec, MLASpec)):
            raise TypeError(f"layer {i}: unknown cache spec {spec!r}")
        by_window.setdefault(spec.sliding_window, []).append(i)
    if not by_window:
        raise ValueError("the model declares no attention layer: nothing to page")
    keys = sorted(by_window, key=lambda w: -1 if w is None else w)
    return [(w, by_window[w]) for w in keys]


def group_bytes_per_block(specs: Sequence[LayerCacheSpec], layer_ids: Sequence[int],
                          block_size: int) -> int:
    return block_size * sum(specs[i].bytes_per_token() for i in layer_ids)


def state_bytes(specs: Sequence[LayerCacheSpec], num_slots: int) -> int:
    return num_slots * sum(s.bytes_per_slot() for s in specs if isinstance(s, StateSpec))


def plan_kv_cache(
    specs: Sequence[LayerCacheSpec], sizing: CacheSizing, budget_bytes: Optional[int] = None,
    num_blocks: Optional[int] = None,
) -> KVCacheLayout:
    """Blocks per group and state slots from a byte budget (or a fixed ``num_blocks``
    per group, sliding groups capped). Raises ConfigError when a group cannot hold one
    sequence of ``max_model_len`` tokens."""
    groups = group_layers(specs)
    has_state = any(isinstance(s, StateSpec) for s in specs)
    num_slots = sizing.max_num_seqs if has_state else 0
    per_block = [group_bytes_per_block(specs, ids, sizing.block_size) for _, ids in groups]
    caps = [_group_cap(w, sizing) for w, _ in groups]
    if num_blocks is not None:
        counts = [num_blocks if cap is None else min(num_blocks, cap) for cap in caps]
    else:
        if budget_bytes is None:
            raise ValueError("plan_kv_cache needs budget_bytes or num_blocks")
        rest = int(budget_bytes) - state_bytes(specs, num_slots)
        if rest <= 0:
            raise ConfigError(
                f"the KV cache budget ({budget_bytes / 2**20:.1f} MB) does not even hold the "
                f"linear-attention state of --max-num-seqs {sizing.max_num_seqs} sequences "
                f"({state_bytes(specs, num_slots) / 2**20:.1f} MB): raise --mem / "
                "--gpu-memory-fraction or lower --max-num-seqs"
            )
        counts = _split_blocks(rest, per_block, caps)
    for (window, _), n, pb in zip(groups, counts, per_block):
        _check_one_sequence(window, n, pb, sizing)
    return KVCacheLayout(
        sizing.block_size,
        tuple(KVCacheGroupConfig(w, int(n), tuple(ids)) for (w, ids), n in zip(groups, counts)),
        num_slots,
    )


def _group_cap(window: Optional[int], s: CacheSizing) -> Optional[int]:
    """Most blocks a sliding group can ever have in use (None: a full group, no cap)."""
    if window is None:
        return None
    per_seq_full = cdiv(s.max_model_len, s.block_size)
    bound = s.max_num_seqs * (cdiv(window - 1, s.block_size) + 2) + cdiv(
        s.max_num_batched_tokens, s.block_size
    )
    return min(s.max_num_seqs * per_seq_full, bound)


def _split_blocks(budget: int, per_block: List[int], caps: List[Optional[int]]) -> List[int]:
    """Equal block counts for every group, sliding groups capped; a capped group's unused
    share goes to the rest."""
    counts: List[int] = [0] * len(per_block)
    open_groups = list(range(len(per_block)))
    while open_groups:
        n = budget // sum(per_block[g] for g in open_groups)
        capped = [g for g in open_groups if caps[g] is not None and caps[g] <= n]
        if not capped:
            for g in open_groups:
                counts[g] = n
            break
        for g in capped:
            counts[g] = caps[g]
            budget -= caps[g] * per_block[g]
            open_groups.remove(g)
    return counts


def _check_one_sequence(window: Optional[int], n: int, per_block: int, s: CacheSizing) -> None:
    need = max_live_blocks(s.max_model_len, s.max_chunk, s.block_size, window)
    if n >= need:
        return
    what = "the KV cache" if window is None else f"the KV cache of the window-{window} layers"
    raise ConfigError(
        f"{what} ({n} blocks of {s.block_size} tokens, {per_block * n / 2**20:.1f} MB) "
        f"cannot hold one sequence of --max-model-len {s.max_model_len} "
        f"({need} blocks, {per_block * need / 2**20:.1f} MB): raise --mem / "
        f"--gpu-memory-fraction or lower --max-model-len"
    )


# ----- allocation ---------------------------------------------------------------------------


def allocate_kv_caches(
    specs: Sequence[LayerCacheSpec], layout: KVCacheLayout, device: torch.device | str
) -> List[LayerCache]:
    """``kv_caches[i]`` for every layer, zeroed (see ``allocate_kv_cache`` for why):
    ``(k, v)`` ``[N_g, bs, Hkv, D]`` for full / sliding layers of group g, ``(kv, None)``
    ``[N_g, bs, kv_lora_rank + qk_rope_head_dim]`` for MLA, and one
    ``[num_state_slots, *shape]`` tensor per state of a ``StateSpec`` layer."""
    blocks_of_layer = {i: g.num_blocks for g in layout.groups for i in g.layer_ids}
    bs = layout.block_size
    caches: List[LayerCache] = []
    for i, spec in enumerate(specs):
        if isinstance(spec, StateSpec):
            caches.append(tuple(
                torch.zeros((layout.num_state_slots, *shape), dtype=dt, device=device)
                for shape, dt in zip(spec.shapes, spec.dtypes)
            ))  # [num_state_slots, *shape] each
            continue
        if i not in blocks_of_layer:
            raise ValueError(f"layer {i} is in no KV cache group of the layout")
        n = blocks_of_layer[i]
        if isinstance(spec, MLASpec):
            width = spec.kv_lora_rank + spec.qk_rope_head_dim
            caches.append((torch.zeros((n, bs, width), dtype=spec.dtype, device=device), None))
        else:
            shape = (n, bs, spec.num_kv_heads, spec.head_dim)  # [N, bs, Hkv, D]
            caches.append(_zeros_kv_cache(shape, spec.dtype, device))
    return caches


def kv_caches_nbytes(caches: Sequence[LayerCache]) -> int:
    """Bytes the allocated caches take (for logs and tests)."""
    return sum(t.numel() * t.element_size() for c in caches for t in c if t is not None)

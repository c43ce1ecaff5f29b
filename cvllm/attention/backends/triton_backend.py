"""Triton paged attention: the GPU backend, a drop-in for ``backends/torch_ref.py``.

Stateless, like the reference (``interface.AttentionBackend``): the attention layer
(``layers/attention.py``) calls ``forward`` once per layer per step with that layer's
``KVCache`` (owned by the worker), the step's ``AttentionMetadata`` view of its KV cache
group (built by the worker) and its ``AttentionParams``. The batch split is host-side,
from ``meta.num_decodes``: the leading one-token sequences go to
``kernels.paged_attention.decode_attention`` (GQA-grouped, split-K), the rest --
prefills, chunked-prefill continuations, and any single-token rows after the first
multi-token one -- to ``prefill_attention``. No step here syncs with the device.

Semantics match the reference exactly: K/V of the ``meta.num_tokens`` real tokens are
written first (slot -1 writes nothing), then every query attends over its sequence's
cache causally, with the window and softcap of the layer; padding rows (past
``num_tokens``) of the output are zero. Given the layer's ``RopeInputs``
(``fused_rope``), q and k are first rotated in place by the kernel that writes K/V
(``kernels/rotary.rotary_write_kv``): one launch per layer fewer, bit-equal to the
rotary kernel followed by the write. Selection is ``attention/backend.py``'s job.
FP8 caches: the ``KVCache``'s ``k_scale`` / ``v_scale`` (``attention/kv_cache.py``) go
to the kernels (calibrated on the device at the cache's first write). Causal only.
"""

from __future__ import annotations

from typing import Optional

import torch

from cvllm.attention.interface import AttentionBackend, AttentionCapabilities, AttentionParams
from cvllm.attention.kv_cache import KVCache, calibrate_kv_scales
from cvllm.attention.metadata import AttentionMetadata, RopeInputs
from cvllm.kernels import paged_attention as pa
from cvllm.kernels import rotary


def write_kv(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    cache: KVCache,  # [N, bs, Hkv, D] each
    slot_mapping: torch.Tensor,  # [T] int64; -1 entries (padding) are skipped
) -> None:
    """Store this step's keys and values at their cache slots (FP8: quantized)."""
    if cache.scales_pending:  # first real write of an FP8 cache only
        calibrate_kv_scales(cache, k, v)
    pa.write_kv(k, v, cache.k, cache.v, slot_mapping,
                k_scale=cache.k_scale, v_scale=cache.v_scale)


def rotary_write_kv(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    cache: KVCache,  # [N, bs, Hkv, D] each
    slot_mapping: torch.Tensor,  # [>= n] int64; -1 entries (padding) are skipped
    n: int,  # real tokens: rows 0..n-1 are written
    rope: RopeInputs,
) -> None:
    """Rotate q and k (every row) in place, then store the first ``n`` rows' keys and
    values at their cache slots: one kernel, except before an FP8 cache's first write,
    whose scale is calibrated on the rotated keys first."""
    if cache.scales_pending:
        rotary.rotary_embedding(rope.positions, q, k, rope.cos_sin_cache, rope.head_size,
                                rope.is_neox_style)
        write_kv(k[:n], v[:n], cache, slot_mapping[:n])
        return
    rotary.rotary_write_kv(rope.positions, q, k, v, rope.cos_sin_cache, rope.head_size,
                           rope.is_neox_style, cache.k, cache.v, slot_mapping, n,
                           k_scale=cache.k_scale, v_scale=cache.v_scale)


def forward(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    kv_cache: KVCache,  # [N, bs, Hkv, D] each
    meta: AttentionMetadata,
    params: AttentionParams,
    rope: Optional[RopeInputs] = None,
    out: Optional[torch.Tensor] = None,  # [T, H, D], like q
) -> torch.Tensor:
    """Write K/V (rotating q and k first when given ``rope``), then attend every
    sequence's queries over its cached context, causally. Returns ``[T, H, D]`` (``out``
    when given); rows of padding tokens (past ``meta.num_tokens``) are zero."""
    n, nd, B = meta.num_tokens, meta.num_decodes, meta.num_seqs
    k_cache, v_cache = kv_cache.k, kv_cache.v
    _check_meta(q, k_cache, meta)
    if rope is None:
        write_kv(k[:n], v[:n], kv_cache, meta.slot_mapping[:n])
    else:
        rotary_write_kv(q, k, v, kv_cache, meta.slot_mapping, n, rope)
    scales = dict(k_scale=kv_cache.k_scale, v_scale=kv_cache.v_scale)  # None unless FP8
    if out is None:
        out = torch.empty_like(q)  # [T, H, D]
    elif out.shape != q.shape or out.dtype != q.dtype or not out.is_contiguous():
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} must be contiguous and like q "
                         f"{tuple(q.shape)} {q.dtype}")
    if n < out.shape[0]:
        out[n:].zero_()
    scale, window, cap = params.scale, params.sliding_window, params.softcap
    if nd:
        # Leading decodes own tokens 0..nd-1, one per sequence.
        pa.decode_attention(
            q[:nd], k_cache, v_cache, meta.block_tables[:nd], meta.seq_lens[:nd], scale,
            sliding_window=window, softcap=cap, out=out[:nd],
            max_seq_len=meta.decode_max_seq_len, **scales,
        )
    if nd < B:
        pa.prefill_attention(
            q, k_cache, v_cache, meta.block_tables[nd:], meta.query_start_loc[nd:],
            meta.seq_lens[nd:], meta.prefill_max_query_len, scale,
            sliding_window=window, softcap=cap, out=out, **scales,
        )
    return out


def _check_meta(q: torch.Tensor, k_cache: torch.Tensor, meta: AttentionMetadata) -> None:
    """Host-side bounds the kernels cannot check without a sync."""
    if q.shape[0] < meta.num_tokens:
        raise ValueError(f"q has {q.shape[0]} rows, the step has {meta.num_tokens} tokens")
    needed = -(-meta.max_seq_len // k_cache.shape[1])
    if meta.num_seqs and needed > meta.block_tables.shape[1]:
        raise ValueError(f"block_tables has {meta.block_tables.shape[1]} columns, {needed} "
                         f"needed for {meta.max_seq_len} tokens")


class TritonAttentionBackend(AttentionBackend):
    """The backend ``attention/backend.py`` hands to attention layers on CUDA: every
    size it launches with comes from the metadata's device tensors and host ints, so
    CUDA graphs (decode and mixed-step) may capture it."""

    name = "triton"
    capabilities = AttentionCapabilities(fused_rope=True, takes_out=True, fp8_cache=True,
                                         cuda_graphs=True, split_graphs=True)
    forward = staticmethod(forward)

"""Oracles of ``kernels/paged_attention/`` (and the torch reference attention backend's
cache arithmetic), one sequence at a time, float32, K/V heads repeated for GQA.

Conventions shared with the kernels: a cache is ``[N, bs, Hkv, D]`` and token slot ``s``
lives at ``cache[s // bs, s % bs]``; ``block_tables[b, j]`` is the j-th block of sequence
b; sequence b's ``q_len`` queries sit at positions ``seq_len - q_len .. seq_len - 1`` and
see key j iff ``j <= pos`` (and ``j > pos - sliding_window``).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

FP8_KV_DTYPE = torch.float8_e4m3fn
"""The FP8 KV cache dtype (``--fp8-kvcache``): e4m3, finite only, largest value 448."""
FP8_E4M3_MAX = 448.0


def quantize_kv_ref(x: torch.Tensor, cache_dtype: torch.dtype,
                    scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x`` as the cache stores it: an FP8 cache holds ``clamp(x / scale, +-448)``
    (saturating: e4m3fn has no inf, an overflow would be NaN); others a plain cast."""
    if cache_dtype != FP8_KV_DTYPE:
        return x.to(cache_dtype)
    xf = x.float() / scale.float()
    return xf.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_KV_DTYPE)


def dequantize_kv_ref(x: torch.Tensor, scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Cached K or V back to float32 (``x * scale`` for FP8)."""
    if x.dtype != FP8_KV_DTYPE:
        return x.float()
    return x.float() * scale.float()


def write_kv_ref(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [N, bs, Hkv, D]
    v_cache: torch.Tensor,  # [N, bs, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int; -1 (padding) writes nothing
    k_scale: Optional[torch.Tensor] = None,  # [1] float32, FP8 caches only
    v_scale: Optional[torch.Tensor] = None,
) -> None:
    """Store token t's K/V at slot ``slot_mapping[t]``, in the cache's dtype."""
    bs = k_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        k_cache[slot // bs, slot % bs] = quantize_kv_ref(k[t], k_cache.dtype, k_scale)
        v_cache[slot // bs, slot % bs] = quantize_kv_ref(v[t], v_cache.dtype, v_scale)


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` tokens of one sequence: ``[length, Hkv, D]``."""
    bs = cache.shape[1]
    pos = torch.arange(length, device=cache.device)  # [L]
    blocks = block_table.long()[pos // bs]  # [L]
    return cache[blocks, pos % bs]  # [L, Hkv, D]


def attend_ref(
    q: torch.Tensor,  # [Q, H, D]
    k: torch.Tensor,  # [L, Hkv, D]
    v: torch.Tensor,  # [L, Hkv, D]
    qpos: torch.Tensor,  # [Q] position of each query
    scale: float,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
) -> torch.Tensor:
    """Causal (windowed, soft-capped) attention of one sequence, float32 -> ``[Q, H, D]``."""
    group = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1)  # [L, H, D]; head h reads kv head h // G
    vf = v.float().repeat_interleave(group, dim=1)  # [L, H, D]
    s = torch.einsum("qhd,khd->hqk", q.float(), kf) * scale  # [H, Q, L]
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    kpos = torch.arange(k.shape[0], device=q.device)[None, :]  # [1, L]
    visible = kpos <= qpos[:, None]  # [Q, L]
    if sliding_window:
        visible &= kpos > qpos[:, None] - sliding_window
    s = s.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), vf)  # [Q, H, D]


def _context_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                length: int, k_scale: Optional[torch.Tensor], v_scale: Optional[torch.Tensor]
                ) -> Tuple[torch.Tensor, torch.Tensor]:
    """The first ``length`` keys and values of one sequence, float32 ``[L, Hkv, D]``."""
    k = dequantize_kv_ref(gather_context(k_cache, block_table, length), k_scale)
    v = dequantize_kv_ref(gather_context(v_cache, block_table, length), v_scale)
    return k, v


def decode_attention_ref(
    q: torch.Tensor,  # [B, H, D]: sequence b's one query, at position seq_lens[b] - 1
    k_cache: torch.Tensor,  # [N, bs, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, M]
    seq_lens: torch.Tensor,  # [B]
    scale: float,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    k_scale: Optional[torch.Tensor] = None,  # [1] float32, FP8 caches only
    v_scale: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Reference of ``decode_attention``: ``[B, H, D]`` in q's dtype."""
    out = torch.empty_like(q)
    for b, seq_len in enumerate(seq_lens.tolist()):
        k, v = _context_kv(k_cache, v_cache, block_tables[b], seq_len, k_scale, v_scale)
        qpos = torch.tensor([seq_len - 1], device=q.device)
        out[b] = attend_ref(q[b : b + 1], k, v, qpos, scale, sliding_window, softcap)[0]
    return out


def prefill_attention_ref(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [N, bs, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, M]
    query_start_loc: torch.Tensor,  # [B+1]: sequence b owns q rows qsl[b]:qsl[b+1]
    seq_lens: torch.Tensor,  # [B]
    scale: float,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    k_scale: Optional[torch.Tensor] = None,  # [1] float32, FP8 caches only
    v_scale: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Reference of ``prefill_attention``: ``[T, H, D]`` in q's dtype; q rows that belong
    to none of the B sequences are zero."""
    out = torch.zeros_like(q)
    qsl = query_start_loc.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        t0, t1 = qsl[b], qsl[b + 1]
        k, v = _context_kv(k_cache, v_cache, block_tables[b], seq_len, k_scale, v_scale)
        qpos = torch.arange(seq_len - (t1 - t0), seq_len, device=q.device)  # [Q]
        out[t0:t1] = attend_ref(q[t0:t1], k, v, qpos, scale, sliding_window, softcap)
    return out


def merge_attention_partials_ref(
    part_out: torch.Tensor,  # [B, H, S, D] float32: each split's softmax-normalised output
    part_lse: torch.Tensor,  # [B, H, S] float32: each split's log2-sum-exp2, -inf if empty
) -> torch.Tensor:
    """Reference of the split-K reduce: weight split s by ``2**lse_s``. ``[B, H, D]`` f32."""
    w = torch.softmax(part_lse * torch.log(torch.tensor(2.0)), dim=-1)  # [B, H, S]
    return (w.unsqueeze(-1) * part_out).sum(dim=2)  # [B, H, D]

"""Paged variable-length (chunked) prefill attention (Triton): each sequence's new
queries, causal over its paged context, which already holds this step's keys.

Called by ``attention/backends/triton_backend.py`` for the prefill (and mixed) part of a
step, eagerly; reference: ``prefill_attention_ref`` in ``kernels/reference/
paged_attention.py``. Layout and FP8 scales: ``common``. ``_prefill_kernel`` is one
program per (BLOCK_M queries, query head, sequence), online softmax over BLOCK_N-key
tiles gathered through the block table, ``tl.dot`` for QK^T and PV with float32
accumulation.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from cvllm.kernels.jit import jit_per_step
from cvllm.kernels.paged_attention.checks import (
    check_attention, check_dtypes, check_out, check_same_device, scale_args,
)
from cvllm.kernels.paged_attention.common import (
    INDEX_DTYPES, STAGES, block_d_for, elt_size, fit_tiles, interpreted, load_kv_tile,
    num_warps_for, online_softmax_step, tile_scores,
)


@jit_per_step(ints=("stride_bt",),
              pointers=("block_tables_ptr", "query_start_loc_ptr", "seq_lens_ptr"))
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, query_start_loc_ptr,
    seq_lens_ptr, k_scale_ptr, v_scale_ptr, scale, softcap, window, block_size, head_dim,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
    stride_kn, stride_kb, stride_kh, stride_vn, stride_vb, stride_vh,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr, IEEE_F32: tl.constexpr,
    FP8: tl.constexpr,
):
    """Query tile ``pid_m`` of head ``h`` of sequence ``b`` over the keys it can see."""
    pid_m, h, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + b)
    q_len = tl.load(query_start_loc_ptr + b + 1) - q_start
    if pid_m * BLOCK_M >= q_len:
        return  # the grid is sized for the longest query of the batch
    if FP8:
        scale = scale * tl.load(k_scale_ptr)
    seq_len = tl.load(seq_lens_ptr + b)
    ctx = seq_len - q_len  # keys cached before this step
    kvh = h // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mmask = offs_m < q_len
    qpos = ctx + offs_m  # [BLOCK_M]
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < head_dim
    rows = (q_start + offs_m).to(tl.int64)
    qmask = mmask[:, None] & dmask[None, :]
    q = tl.load(q_ptr + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                mask=qmask, other=0.0)  # [BLOCK_M, BLOCK_D]
    # Causal: no key past this tile's last query; window: none before its first's window.
    hi = tl.minimum(seq_len, ctx + (pid_m + 1) * BLOCK_M)
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(ctx + pid_m * BLOCK_M - window + 1, 0)
    m_i = tl.full([BLOCK_M], -1e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    for n0 in range(lo, hi, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        pmask = pos < hi
        k = load_kv_tile(k_cache_ptr, bt_row, pos, pmask, offs_d, dmask, kvh, block_size,
                          stride_kn, stride_kb, stride_kh).to(q.dtype)  # [BLOCK_N, BLOCK_D]
        s = tile_scores(q, k, scale, softcap, USE_SOFTCAP, IEEE_F32)  # [BLOCK_M, BLOCK_N]
        visible = (pos[None, :] <= qpos[:, None]) & pmask[None, :]
        if USE_WINDOW:
            visible = visible & (pos[None, :] > qpos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        v = load_kv_tile(v_cache_ptr, bt_row, pos, pmask, offs_d, dmask, kvh, block_size,
                          stride_vn, stride_vb, stride_vh).to(q.dtype)
        m_i, l_i, acc = online_softmax_step(s, m_i, l_i, acc, v, IEEE_F32)
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if FP8:
        o = o * tl.load(v_scale_ptr)
    tl.store(out_ptr + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=qmask)


def prefill_config(max_query_len: int, head_dim: int, elt_bytes: int,
                   interpreting: bool) -> Tuple[int, int]:
    """``(BLOCK_M, BLOCK_N)``: 64x64 tiles on Hopper for 16-bit heads up to 128, fewer
    queries when no sequence has that many, smaller tiles where they would not fit the
    shared memory; 16x16 in the interpreter (its cost is per element)."""
    if interpreting:
        return 16, 16
    block_m = min(64, max(16, triton.next_power_of_2(max(max_query_len, 1))))
    return fit_tiles(block_m, 64, block_d_for(head_dim), elt_bytes, shrink_m=True)


def prefill_attention(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [N, bs, Hkv, D]
    v_cache: torch.Tensor,  # [N, bs, Hkv, D]
    block_tables: torch.Tensor,  # [B, M] int32/int64
    query_start_loc: torch.Tensor,  # [B+1] int32/int64: sequence b owns q rows qsl[b]:qsl[b+1]
    seq_lens: torch.Tensor,  # [B] int32/int64
    max_query_len: int,
    scale: float,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    out: Optional[torch.Tensor] = None,  # [T, H, D]; rows of other sequences left untouched
    k_scale: Optional[torch.Tensor] = None,  # [1] float32: FP8 caches only
    v_scale: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Variable-length causal attention of each sequence's queries over its paged context
    (which already holds this step's keys) -> ``out``. ``max_query_len`` is a host bound
    on the query lengths: it sizes the grid. When ``out`` is None it is zero-filled, so
    rows of no sequence are zero as in ``prefill_attention_ref``."""
    B = seq_lens.shape[0]
    check_attention(q, k_cache, v_cache, block_tables, seq_lens, B)
    if query_start_loc.dim() != 1 or query_start_loc.shape[0] != B + 1:
        raise ValueError(f"query_start_loc {tuple(query_start_loc.shape)} must be [B+1={B + 1}]")
    check_dtypes(query_start_loc=(query_start_loc, INDEX_DTYPES))
    check_same_device(q, query_start_loc)
    ks, vs, fp8 = scale_args(k_cache, k_scale, v_scale)
    if out is None:
        out = torch.zeros_like(q)
    out = check_out(q, out)
    T, H, D = q.shape
    if B == 0 or T == 0 or max_query_len <= 0:
        return out
    bm, bn = prefill_config(max_query_len, D, elt_size(q, k_cache), interpreted(q))
    window = int(sliding_window) if sliding_window else 0
    grid = (triton.cdiv(max_query_len, bm), H, B)
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, block_tables, query_start_loc, seq_lens, ks, vs,
        float(scale), float(softcap or 0.0), window, k_cache.shape[1], D,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        *k_cache.stride()[:3], *v_cache.stride()[:3],
        GROUP=H // k_cache.shape[2], BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=block_d_for(D),
        USE_SOFTCAP=bool(softcap), USE_WINDOW=bool(window), IEEE_F32=q.dtype == torch.float32,
        FP8=fp8, num_warps=num_warps_for(D, elt_size(q, k_cache)), num_stages=STAGES,
    )
    return out

"""Paged decode attention (Triton): one query token per sequence over its paged context.

Called by ``attention/backends/triton_backend.py`` for the decodes of a step (inside the
decode CUDA graphs too); reference: ``decode_attention_ref`` in ``kernels/reference/
paged_attention.py``. Layout and FP8 scales: ``common``.

- ``_decode_kernel``: one program per (sequence, KV head, split). The G = H / Hkv query
  heads that share a KV head are the rows of one ``tl.dot`` tile (padded to 16), so each
  K/V tile is read once for the whole group. Long contexts are split along the sequence
  (flash-decoding); each split writes its normalised output and log2-sum-exp2, then
  ``_merge_kernel`` combines them. With ``fused_merge`` (``CVLLM_FUSED_MERGE``,
  docs/kernels.md) only the splits that hold keys of the sequence take part (a grid
  planned for ``max_seq_len``, as in a CUDA graph, has many empty ones at a short
  context): one alone writes the output itself; more take tickets from a per-(sequence,
  KV head) counter and the one that arrives last merges its group's partials
  (``_merge_active``, every head and split of a load in flight at once) and resets the
  counter to 0, with no second launch; the counters live in one zeroed int32 buffer per
  device that every call reuses (``_TICKETS``, the only state here). With one planned
  split the decode kernel writes the output directly.

On Hopper the decode and merge kernels are launched with PDL and wait (``gdc_wait``)
before they read what earlier kernels wrote: each is resident when the kernel before it
ends (``kernels/pdl.py``). The decode kernel reads its sequence's length before the
wait (a step input, copied in before the step's first kernel), and its splits past the
keys return before it, so they hold no SM slot while the kernels before finish.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from cvllm.kernels import pdl
from cvllm.kernels.device import sms_of
from cvllm.kernels.jit import jit_per_step
from cvllm.kernels.paged_attention.checks import (
    check_attention, check_inner_contiguous, check_out, check_same_device, scale_args,
)
from cvllm.kernels.paged_attention.common import (
    STAGES, block_d_for, elt_size, fit_tiles, interpreted, load_kv_tile, num_warps_for,
    online_softmax_step, tile_scores,
)
from cvllm.kernels.pdl import gdc_enter, gdc_launch_dependents, gdc_wait
from cvllm.utils import tuning

_MIN_SPLIT_TOKENS = 64
"""A decode split shorter than this costs more in the merge than it saves (batch-1 sweep
on an H100, docs/benchmarks/kernels-h100.json: 64-key splits beat 32, 128 and 256 at
every context from 128 to 2048 keys)."""
_MAX_SPLITS = 64


@triton.jit
def _merge_active(part_out_ptr, part_lse_ptr, out_ptr, b, kvh, n_act, num_splits, num_heads,
                  head_dim, stride_ob, stride_oh, GROUP: tl.constexpr, BLOCK_GM: tl.constexpr,
                  BLOCK_SM: tl.constexpr, BLOCK_D: tl.constexpr):
    """``out[b, h] = sum_s 2**lse_s * o_s / sum_s 2**lse_s`` over the ``n_act`` splits
    that hold keys, for the GROUP heads of KV head ``kvh`` at once: ``BLOCK_SM`` splits a
    load (``[BLOCK_GM, BLOCK_SM, BLOCK_D]``, all in flight together), the running
    maximum rescaling the sums between loads. Reads go to L2 (``.cg``): the partials were
    written by other programs."""
    offs_g = tl.arange(0, BLOCK_GM)
    offs_s = tl.arange(0, BLOCK_SM)
    offs_d = tl.arange(0, BLOCK_D)
    gmask, dmask = offs_g < GROUP, offs_d < head_dim
    heads = kvh * GROUP + offs_g  # [BLOCK_GM]
    m = tl.full([BLOCK_GM], float("-inf"), tl.float32)
    wsum = tl.zeros([BLOCK_GM], tl.float32)
    acc = tl.zeros([BLOCK_GM, BLOCK_D], tl.float32)
    for s0 in range(0, n_act, BLOCK_SM):
        s = s0 + offs_s
        mask = gmask[:, None] & (s < n_act)[None, :]  # [BLOCK_GM, BLOCK_SM]
        row = (b * num_heads + heads)[:, None] * num_splits + s[None, :]
        lse = tl.load(part_lse_ptr + row, mask=mask, other=float("-inf"), cache_modifier=".cg")
        o = tl.load(part_out_ptr + row[:, :, None] * head_dim + offs_d[None, None, :],
                    mask=mask[:, :, None] & dmask[None, None, :], other=0.0,
                    cache_modifier=".cg")  # [BLOCK_GM, BLOCK_SM, BLOCK_D]
        m_new = tl.maximum(m, tl.max(lse, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        w = tl.exp2(lse - m_ref[:, None])  # [BLOCK_GM, BLOCK_SM]
        alpha = tl.exp2(m - m_ref)  # 0 before the first load
        wsum = wsum * alpha + tl.sum(w, 1)
        acc = acc * alpha[:, None] + tl.sum(o * w[:, :, None], 1)
        m = m_new
    res = acc / tl.maximum(wsum, 1e-30)[:, None]
    tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
             res.to(out_ptr.dtype.element_ty), mask=gmask[:, None] & dmask[None, :])


@jit_per_step(ints=("split_len", "num_splits", "stride_bt"),
              pointers=("block_tables_ptr", "seq_lens_ptr", "ticket_ptr"))
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, out_ptr, part_out_ptr,
    part_lse_ptr, ticket_ptr, k_scale_ptr, v_scale_ptr, scale, softcap, window, block_size,
    split_len, num_splits, num_heads, head_dim, stride_qb, stride_qh, stride_ob, stride_oh,
    stride_bt, stride_kn, stride_kb, stride_kh, stride_vn, stride_vb, stride_vh,
    DIRECT: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, USE_SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr,
    IEEE_F32: tl.constexpr, FP8: tl.constexpr, FUSED_MERGE: tl.constexpr,
    BLOCK_GM: tl.constexpr, BLOCK_SM: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr,
):
    """The GROUP query heads of KV head ``kvh``, sequence ``b``, over split ``s`` of its keys
    ``[start, seq_len)``. ``FUSED_MERGE``: only the ``n_act`` splits holding keys take part
    (the others return at once); one writes ``out`` itself, or the last of more merges."""
    b, kvh, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    start = 0
    if USE_WINDOW:
        start = tl.maximum(seq_len - window, 0)
    lo = start + split * split_len
    hi = tl.minimum(lo + split_len, seq_len)
    n_act = num_splits
    if FUSED_MERGE:  # splits past the keys: nothing to add (split 0 still writes zeros)
        n_act = tl.minimum(tl.cdiv(seq_len - start, split_len), num_splits)
        if split >= tl.maximum(n_act, 1):
            return  # before the wait: an idle program does not hold its SM slot meanwhile
    if PDL:  # q and the cache come from the kernels before (launched with PDL)
        gdc_enter(EARLY)
    if FP8:
        scale = scale * tl.load(k_scale_ptr)  # q.(k8 * ks) = (q.k8) * ks
    offs_g = tl.arange(0, BLOCK_G)
    heads = kvh * GROUP + offs_g  # [BLOCK_G]
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < head_dim
    qmask = (offs_g[:, None] < GROUP) & dmask[None, :]
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=qmask, other=0.0)  # [BLOCK_G, BLOCK_D]
    m_i = tl.full([BLOCK_G], -1e30, tl.float32)  # finite: a fully masked tile stays NaN-free
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    for n0 in range(lo, hi, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        pmask = pos < hi
        k = load_kv_tile(k_cache_ptr, bt_row, pos, pmask, offs_d, dmask, kvh, block_size,
                          stride_kn, stride_kb, stride_kh).to(q.dtype)  # [BLOCK_N, BLOCK_D]
        s = tile_scores(q, k, scale, softcap, USE_SOFTCAP, IEEE_F32)  # [BLOCK_G, BLOCK_N]
        s = tl.where(pmask[None, :], s, float("-inf"))
        v = load_kv_tile(v_cache_ptr, bt_row, pos, pmask, offs_d, dmask, kvh, block_size,
                          stride_vn, stride_vb, stride_vh).to(q.dtype)
        m_i, l_i, acc = online_softmax_step(s, m_i, l_i, acc, v, IEEE_F32)
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # an empty split: zeros
    if FP8:
        o = o * tl.load(v_scale_ptr)  # sum p (v8 * vs) = (sum p v8) * vs
    o_ptrs = out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
    row = (b * num_heads + heads) * num_splits + split  # [BLOCK_G] into [B, H, S]
    lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
    if DIRECT:  # a single split: no merge needed
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=qmask)
    elif not FUSED_MERGE:
        tl.store(part_out_ptr + row[:, None] * head_dim + offs_d[None, :], o, mask=qmask)
        tl.store(part_lse_ptr + row, lse, mask=offs_g < GROUP)
    elif n_act <= 1:  # the only split with keys (or none: zeros)
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=qmask)
    else:
        tl.store(part_out_ptr + row[:, None] * head_dim + offs_d[None, :], o, mask=qmask)
        tl.store(part_lse_ptr + row, lse, mask=offs_g < GROUP)
        # Every thread's partials are issued before the ticket; the acq_rel atomic (one
        # thread, gpu scope) publishes them and, for the last split, acquires the others'.
        tl.debug_barrier()
        counter = ticket_ptr + b * tl.num_programs(1) + kvh
        ticket = tl.atomic_add(counter, 1, sem="acq_rel")
        if ticket == n_act - 1:
            tl.store(counter, 0)  # ready for the next call (and the next CUDA graph replay)
            _merge_active(part_out_ptr, part_lse_ptr, out_ptr, b, kvh, n_act, num_splits,
                          num_heads, head_dim, stride_ob, stride_oh, GROUP=GROUP,
                          BLOCK_GM=BLOCK_GM, BLOCK_SM=BLOCK_SM, BLOCK_D=BLOCK_D)


@jit_per_step(ints=("num_splits",))
def _merge_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, num_splits, num_heads, head_dim, stride_ob, stride_oh,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    """``out[b, h] = sum_s 2**lse_s * o_s / sum_s 2**lse_s`` over the splits."""
    if PDL:
        gdc_wait()  # the partials come from the decode kernel (launched with PDL)
        gdc_launch_dependents()  # a PDL GEMV after this may start loading its weights
    b, h = tl.program_id(0), tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    smask, dmask = offs_s < num_splits, offs_d < head_dim
    row = (b * num_heads + h) * num_splits + offs_s  # [BLOCK_S]
    lse = tl.load(part_lse_ptr + row, mask=smask, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))  # [BLOCK_S]
    o = tl.load(part_out_ptr + row[:, None] * head_dim + offs_d[None, :],
                mask=smask[:, None] & dmask[None, :], other=0.0)  # [BLOCK_S, BLOCK_D]
    res = tl.sum(o * w[:, None], 0) / tl.maximum(tl.sum(w, 0), 1e-30)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_d, res.to(out_ptr.dtype.element_ty),
             mask=dmask)


def merge_block_s(num_splits: int) -> int:
    """The merge kernel's split tile: 16, or ``_MAX_SPLITS`` rounded up to a power of two
    for more splits. Two variants only (a power of two per split count compiled a new
    kernel each time an eager decode's context crossed one)."""
    return 16 if num_splits <= 16 else triton.next_power_of_2(max(num_splits, _MAX_SPLITS))


def merge_attention_partials(
    part_out: torch.Tensor,  # [B, H, S, D] float32, contiguous
    part_lse: torch.Tensor,  # [B, H, S] float32, contiguous
    out: torch.Tensor,  # [B, H, D]
) -> torch.Tensor:
    """The split-K reduce of ``decode_attention`` (reference: ``merge_attention_partials_ref``)."""
    B, H, S, D = part_out.shape
    if part_out.dtype != torch.float32 or part_lse.dtype != torch.float32:
        raise ValueError("part_out and part_lse must be float32")
    if tuple(part_lse.shape) != (B, H, S) or tuple(out.shape) != (B, H, D):
        raise ValueError(f"part_lse {tuple(part_lse.shape)} / out {tuple(out.shape)} do not fit "
                         f"part_out {tuple(part_out.shape)}")
    if not (part_out.is_contiguous() and part_lse.is_contiguous()):
        raise ValueError("part_out and part_lse must be contiguous")
    check_inner_contiguous(out=out)
    check_same_device(part_out, part_lse, out)
    if B:
        _merge_kernel[(B, H)](
            part_out, part_lse, out, S, H, D, out.stride(0), out.stride(1),
            BLOCK_S=merge_block_s(S), BLOCK_D=triton.next_power_of_2(D),
            PDL=pdl.enabled(out), **pdl.launch_args(out),
        )
    return out


def merge_block_sm(group: int, head_dim: int) -> int:
    """Splits a load of ``_merge_active``: up to 32, and at most 16K float32 of partials
    (``[BLOCK_GM, BLOCK_SM, BLOCK_D]``, 64 registers a thread at 8 warps), so a batch-1
    graph's splits (34 planned for 2,065 keys on an H200) are read in one or two loads
    (32 for Llama 3's groups of 4 heads of 128). One load a split at a time, with the
    rescaling between, cost 11.3 us a layer at 2,048 keys against 9.2 for the separate
    merge kernel (8 splits a load; H200, docs/benchmarks/kernels-decode-fused-h200.json)."""
    rows = 16384 // block_d_for(head_dim)
    return max(2, min(32, rows // max(2, triton.next_power_of_2(group))))


def plan_decode_splits(
    batch: int, num_kv_heads: int, max_span: int, block_n: int, num_sms: int
) -> Tuple[int, int]:
    """``(num_splits, split_len)`` for ``decode_attention``: enough programs for about
    two waves over the SMs, each split at least ``_MIN_SPLIT_TOKENS`` keys and a
    multiple of ``block_n``; ``max_span`` bounds every sequence's visible key count."""
    programs = max(batch * num_kv_heads, 1)
    want = triton.cdiv(2 * num_sms, programs)
    splits = max(1, min(want, triton.cdiv(max_span, _MIN_SPLIT_TOKENS), _MAX_SPLITS))
    split_len = triton.cdiv(triton.cdiv(max(max_span, 1), splits), block_n) * block_n
    return triton.cdiv(max(max_span, 1), split_len), split_len


def _decode_plan(q: torch.Tensor, k_cache: torch.Tensor, block_g: int, span: int,
                 num_splits: Optional[int], block_n: Optional[int]) -> Tuple[int, int, int]:
    """``(BLOCK_N, num_splits, split_len)`` for ``span`` visible keys at most."""
    if block_n is None:
        block_n = 16 if interpreted(q) else fit_tiles(
            block_g, 64, block_d_for(q.shape[2]), elt_size(q, k_cache), shrink_m=False)[1]
    if num_splits is None:
        sms = sms_of(q)
        return (block_n, *plan_decode_splits(q.shape[0], k_cache.shape[2], span, block_n, sms))
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    split_len = triton.cdiv(triton.cdiv(max(span, 1), num_splits), block_n) * block_n
    return block_n, num_splits, split_len


def decode_attention(
    q: torch.Tensor,  # [B, H, D]: sequence b's one query, at position seq_lens[b] - 1
    k_cache: torch.Tensor,  # [N, bs, Hkv, D]
    v_cache: torch.Tensor,  # [N, bs, Hkv, D]
    block_tables: torch.Tensor,  # [B, M] int32/int64
    seq_lens: torch.Tensor,  # [B] int32/int64, context length including the query
    scale: float,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    out: Optional[torch.Tensor] = None,  # [B, H, D], any row stride
    max_seq_len: Optional[int] = None,
    num_splits: Optional[int] = None,
    block_n: Optional[int] = None,
    k_scale: Optional[torch.Tensor] = None,  # [1] float32: FP8 caches only
    v_scale: Optional[torch.Tensor] = None,
    fused_merge: Optional[bool] = None,
) -> torch.Tensor:
    """One query token per sequence over its paged context -> ``out [B, H, D]``.
    ``fused_merge`` (default ``CVLLM_FUSED_MERGE``, ``utils/tuning.py``) merges the splits
    in the decode kernel instead of a second kernel.

    ``max_seq_len`` must bound ``seq_lens`` (read from the device when None, which syncs):
    the splits cover that many keys. It and ``num_splits`` (planned when None) set the
    grid; fix both to keep it constant, e.g. for CUDA graphs. Reference:
    ``decode_attention_ref``."""
    check_attention(q, k_cache, v_cache, block_tables, seq_lens, q.shape[0])
    ks, vs, fp8 = scale_args(k_cache, k_scale, v_scale)
    out = check_out(q, out)
    B, H, D = q.shape
    hkv = k_cache.shape[2]
    if B == 0:
        return out
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    window = int(sliding_window) if sliding_window else 0
    block_g = max(16, triton.next_power_of_2(H // hkv))  # tl.dot needs M >= 16
    block_n, num_splits, split_len = _decode_plan(
        q, k_cache, block_g, min(max_seq_len, window) if window else max_seq_len,
        num_splits, block_n)
    direct = num_splits == 1
    part_out = part_lse = out  # unused placeholders when direct
    tickets = seq_lens  # unused placeholder unless the merge is fused
    fused = tuning.current().fused_merge if fused_merge is None else bool(fused_merge)
    if not direct:
        part_out = torch.empty(B, H, num_splits, D, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(B, H, num_splits, dtype=torch.float32, device=q.device)
        if fused:
            tickets = _ticket_counters(q.device, B * hkv)
    group = H // hkv
    _decode_kernel[(B, hkv, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, part_out, part_lse, tickets, ks, vs,
        float(scale), float(softcap or 0.0), window, k_cache.shape[1], split_len, num_splits,
        H, D, q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        *k_cache.stride()[:3], *v_cache.stride()[:3],
        DIRECT=direct, GROUP=group, BLOCK_G=block_g, BLOCK_N=block_n, BLOCK_D=block_d_for(D),
        USE_SOFTCAP=bool(softcap), USE_WINDOW=bool(window), IEEE_F32=q.dtype == torch.float32,
        # The merge's tiles depend on the group only, so eager decodes whose split count
        # changes with the context compile no new variants.
        FP8=fp8, FUSED_MERGE=fused and not direct, PDL=pdl.enabled(q),
        BLOCK_GM=max(2, triton.next_power_of_2(group)), BLOCK_SM=merge_block_sm(group, D),
        EARLY=pdl.early_trigger(q, "attn"),
        num_warps=num_warps_for(D, elt_size(q, k_cache)), num_stages=STAGES,
        **pdl.launch_args(q),
    )
    if not direct and not fused:
        merge_attention_partials(part_out, part_lse, out)
    return out


_TICKETS: dict = {}
"""``(device type, index)`` -> the split counter buffers made so far, newest last."""


def _ticket_counters(device: torch.device, n: int) -> torch.Tensor:
    """The device's zeroed int32 split counters, at least ``n`` of them. Each decode
    leaves them at 0, so the buffer is shared by every call (and CUDA graph) in the
    stream order. Planned splits need ``n < 2 * SMs``, far below the first size; a
    larger buffer is made (zeroed) only outside a CUDA graph capture, whose replays
    would otherwise read counters that no replay had zeroed. Replaced buffers stay
    referenced: graphs captured earlier keep their address."""
    key = (device.type, device.index)
    bufs = _TICKETS.setdefault(key, [])
    if not bufs or bufs[-1].numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("decode split counters must be allocated before CUDA graph "
                               "capture (run one eager decode of this batch size first)")
        size = max(n, 4096 if not bufs else 2 * bufs[-1].numel())
        bufs.append(torch.zeros(size, dtype=torch.int32, device=device))
    return bufs[-1]

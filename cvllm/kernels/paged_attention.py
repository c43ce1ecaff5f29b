"""Paged attention in Triton: the K/V cache write, decode, and (chunked) prefill.

Called by ``attention/backends/triton_backend.py`` once per layer per step; the torch
oracles, in the same calling conventions, are in ``kernels/reference.py``
(tests: tests/kernels/test_paged_attention.py, also run on the CPU under
``TRITON_INTERPRET=1``). Caches are owned by the worker; nothing here keeps state.

Layout (same as the torch reference backend): a cache is ``[N, bs, Hkv, D]``; token slot
``s`` lives at ``cache[s // bs, s % bs]``; ``block_tables[b, j]`` is sequence b's j-th
block. Sequence b's ``q_len`` queries sit at positions ``seq_len - q_len .. seq_len - 1``
and see key j iff ``j <= pos`` and, with a window W, ``j > pos - W``. Keys are only ever
read through masked loads, so never-written or freed (clamped-to-0) blocks outside a
sequence's visible range cannot leak into its output, not even as NaN.

Kernels:

- ``_write_kv_kernel``: one program per token (x a tile of KV heads); slot < 0 (padding)
  writes nothing, so it can run over a padded batch.
- ``_decode_kernel``: one program per (sequence, KV head, split). The G = H / Hkv query
  heads that share a KV head are the rows of one ``tl.dot`` tile (padded to 16), so each
  K/V tile is read once for the whole group. Long contexts are split along the sequence
  (flash-decoding); each split writes its normalised output and log2-sum-exp2, then
  ``_merge_kernel`` combines them. With ``fused_merge`` only the splits that hold keys
  of the sequence take part (a grid planned for ``max_seq_len``, as in a CUDA graph,
  has many empty ones at a short context): one alone writes the output itself; more
  take tickets from a per-(sequence, KV head) counter and the one that arrives last
  merges its group's partials (``_merge_active``, every head and split of a load in
  flight at once) and resets the counter to 0, with no second launch; the counters
  live in one zeroed int32 buffer per device that every call reuses. With one planned
  split the decode kernel writes the output directly.
- ``_prefill_kernel``: one program per (BLOCK_M queries, query head, sequence) for
  variable-length batches, online softmax over BLOCK_N-key tiles gathered through the
  block table, ``tl.dot`` for QK^T and PV with float32 accumulation.

On Hopper the decode and merge kernels are launched with PDL and wait (``gdc_wait``)
before they read what earlier kernels wrote: each is resident when the kernel before it
ends (``kernels/pdl.py``). The decode kernel reads its sequence's length before the
wait (a step input, copied in before the step's first kernel), and its splits past the
keys return before it, so they hold no SM slot while the kernels before finish.

Scores are float32 throughout: ``s = scale * q.k``, then ``softcap * tanh(s / softcap)``,
then the softmax in base 2.

FP8 caches (``torch.float8_e4m3fn``, ``--fp8-kvcache``): every kernel then takes
``k_scale`` / ``v_scale``, one float32 per tensor on the device (read by the kernel, so a
new value needs no recompile and no CUDA graph recapture). The write stores
``clamp(x / scale, +-448)``; the reads cast the e4m3 tile to q's dtype for ``tl.dot`` and
fold the scales into the math instead of rescaling every element: ``k_scale`` into the
score scale, ``v_scale`` into the normalised output (attention is linear in V).
"""

from __future__ import annotations

import functools
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from cvllm.kernels import pdl
from cvllm.kernels.jit import jit_per_step
from cvllm.kernels.pdl import gdc_enter, gdc_launch_dependents, gdc_wait
from cvllm.utils import tuning

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)
_FP8 = torch.float8_e4m3fn
_CACHE_DTYPES = _FLOAT_DTYPES + (_FP8,)
_MIN_SPLIT_TOKENS = 64
"""A decode split shorter than this costs more in the merge than it saves (batch-1 sweep
on an H100, docs/benchmarks/kernels-h100.json: 64-key splits beat 32, 128 and 256 at
every context from 128 to 2048 keys)."""
_MAX_SPLITS = 64
_STAGES = 2
"""Software-pipelining depth of the K/V loads in the decode and prefill loops."""
_SMEM_BUDGET = 128 * 1024
"""Shared memory a tile plan may use (H100/H200 allow 227 KB per program): headroom for
the compiler's own scratch and layout conversions."""


# ----- device helpers -----------------------------------------------------------------


@triton.jit
def _dot(a, b, IEEE_F32: tl.constexpr):
    # float32 inputs would otherwise go through TF32 on Hopper (10-bit mantissa).
    if IEEE_F32:
        r = tl.dot(a, b, input_precision="ieee")
    else:
        r = tl.dot(a, b)
    return r


@triton.jit
def _scores(q, k, scale, softcap, USE_SOFTCAP: tl.constexpr, IEEE_F32: tl.constexpr):
    """``[R, D] x [C, D] -> [R, C]`` float32 scores in log2 units, soft-capped."""
    s = _dot(q, tl.trans(k), IEEE_F32) * scale
    if USE_SOFTCAP:
        # tanh(x) = 1 - 2 / (exp(2x) + 1): saturates cleanly to +-1 when exp overflows.
        s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))
    return s * 1.4426950408889634  # log2(e): the softmax runs on exp2


@triton.jit
def _load_kv_tile(cache_ptr, block_tables_ptr, pos, pmask, offs_d, dmask, kv_head,
                  block_size, stride_n, stride_b, stride_h):
    """Keys (or values) at positions ``pos [C]`` of one sequence -> ``[C, BLOCK_D]``;
    ``block_tables_ptr`` points at that sequence's row."""
    blk = tl.load(block_tables_ptr + pos // block_size, mask=pmask, other=0).to(tl.int64)
    row = blk * stride_n + (pos % block_size).to(tl.int64) * stride_b + kv_head * stride_h
    ptrs = cache_ptr + row[:, None] + offs_d[None, :]
    return tl.load(ptrs, mask=pmask[:, None] & dmask[None, :], other=0.0)


@triton.jit
def _online_softmax_step(s, m_i, l_i, acc, v, IEEE_F32: tl.constexpr):
    """Fold one tile of (masked, log2) scores ``s [R, C]`` and values ``v [C, D]`` into
    the running max ``m_i [R]``, sum ``l_i [R]`` and output ``acc [R, D]``."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])  # masked scores are -inf -> exactly 0
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE_F32)
    return m_new, l_i, acc


# ----- K/V write ------------------------------------------------------------------------


@triton.jit
def _to_e4m3_grid(x):
    """float32 ``x`` saturated at e4m3fn's +-448 (an overflowing cast would be NaN) and
    rounded to nearest-even on the e4m3 grid, in float32, so that the cast that follows
    is exact. Rounding here rather than in the cast keeps the interpreter (whose float8
    cast drops the carry: 1.97 -> 1.0) in step with the GPU and the torch reference.
    Adding then subtracting ``c = 1.5 * 2**(e + 23)`` rounds to multiples of ``2**e``,
    the e4m3 step at |x| (3 mantissa bits, no smaller than 2**-9 for subnormals)."""
    x = tl.minimum(tl.maximum(x, -448.0), 448.0)
    exp = ((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # floor(log2|x|)
    step = tl.maximum(exp, -6) - 3  # log2 of the e4m3 spacing at |x|
    c = ((step + 23 + 127) << 23).to(tl.float32, bitcast=True) * 1.5
    r = (x + c) - c
    return tl.where(x < 0, -tl.abs(r), r)  # a negative that rounds to 0 stays -0, as in torch


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
    num_kv_heads, head_dim, block_size,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcn, stride_kcb, stride_kch, stride_vcn, stride_vcb, stride_vch,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr,
):
    """Token ``t``'s K and V rows of a BLOCK_H tile of KV heads into slot_mapping[t]."""
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    blk, off = slot // block_size, slot % block_size
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h[:, None] < num_kv_heads) & (d[None, :] < head_dim)
    k = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    kc = k_cache_ptr + blk * stride_kcn + off * stride_kcb + h[:, None] * stride_kch + d[None, :]
    vc = v_cache_ptr + blk * stride_vcn + off * stride_vcb + h[:, None] * stride_vch + d[None, :]
    if FP8:
        k = _to_e4m3_grid(k.to(tl.float32) / tl.load(k_scale_ptr))
        v = _to_e4m3_grid(v.to(tl.float32) / tl.load(v_scale_ptr))
    tl.store(kc, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(vc, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [N, bs, Hkv, D]
    v_cache: torch.Tensor,  # [N, bs, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int32/int64; -1 = padding, nothing written
    k_scale: Optional[torch.Tensor] = None,  # [1] float32: FP8 caches only
    v_scale: Optional[torch.Tensor] = None,  # [1] float32: FP8 caches only
) -> None:
    """Store this step's keys and values at their cache slots (cast to the cache dtype;
    FP8: ``clamp(x / scale, +-448)``). Slots are not range-checked on the device (that
    would sync). Reference: ``write_kv_ref``."""
    _check_caches(k_cache, v_cache)
    ks, vs, fp8 = _scale_args(k_cache, k_scale, v_scale)
    if k.dim() != 3 or v.shape != k.shape or tuple(k.shape[1:]) != tuple(k_cache.shape[2:]):
        raise ValueError(f"k {tuple(k.shape)} / v {tuple(v.shape)} must be [T, Hkv, D] "
                         f"matching the cache {tuple(k_cache.shape)}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != k.shape[0]:
        raise ValueError(f"slot_mapping {tuple(slot_mapping.shape)} must be [T={k.shape[0]}]")
    _check_dtypes(k=(k, _FLOAT_DTYPES), v=(v, _FLOAT_DTYPES),
                  slot_mapping=(slot_mapping, _INDEX_DTYPES))
    _check_inner_contiguous(k=k, v=v)
    _check_same_device(k, v, k_cache, v_cache, slot_mapping)
    T, hkv, d = k.shape
    if T == 0:
        return
    block_d = triton.next_power_of_2(d)
    block_h = min(triton.next_power_of_2(hkv), max(1, 4096 // block_d))
    grid = (T, triton.cdiv(hkv, block_h))
    _write_kv_kernel[grid](
        k, v, k_cache, v_cache, slot_mapping, ks, vs, hkv, d, k_cache.shape[1],
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        *k_cache.stride()[:3], *v_cache.stride()[:3],
        BLOCK_H=block_h, BLOCK_D=block_d, FP8=fp8,
    )


# ----- decode -------------------------------------------------------------------------------


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
        k = _load_kv_tile(k_cache_ptr, bt_row, pos, pmask, offs_d, dmask, kvh, block_size,
                          stride_kn, stride_kb, stride_kh).to(q.dtype)  # [BLOCK_N, BLOCK_D]
        s = _scores(q, k, scale, softcap, USE_SOFTCAP, IEEE_F32)  # [BLOCK_G, BLOCK_N]
        s = tl.where(pmask[None, :], s, float("-inf"))
        v = _load_kv_tile(v_cache_ptr, bt_row, pos, pmask, offs_d, dmask, kvh, block_size,
                          stride_vn, stride_vb, stride_vh).to(q.dtype)
        m_i, l_i, acc = _online_softmax_step(s, m_i, l_i, acc, v, IEEE_F32)
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
    _check_inner_contiguous(out=out)
    _check_same_device(part_out, part_lse, out)
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
    rows = 16384 // _block_d(head_dim)
    return max(2, min(32, rows // max(2, triton.next_power_of_2(group))))


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


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
        block_n = 16 if _interpreting(q) else fit_tiles(
            block_g, 64, _block_d(q.shape[2]), _elt_bytes(q, k_cache), shrink_m=False)[1]
    if num_splits is None:
        sms = _num_sms(q.device.index or 0) if q.device.type == "cuda" else 1
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
    ``fused_merge`` (default ``CVLLM_FUSED_MERGE``, ``utils/tuning.py``) merges the splits in the decode kernel
    instead of a second kernel.

    ``max_seq_len`` must bound ``seq_lens`` (read from the device when None, which syncs):
    the splits cover that many keys. It and ``num_splits`` (planned when None) set the
    grid; fix both to keep it constant, e.g. for CUDA graphs. Reference:
    ``decode_attention_ref``."""
    _check_attention(q, k_cache, v_cache, block_tables, seq_lens, q.shape[0])
    ks, vs, fp8 = _scale_args(k_cache, k_scale, v_scale)
    out = _check_out(q, out)
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
        DIRECT=direct, GROUP=group, BLOCK_G=block_g, BLOCK_N=block_n, BLOCK_D=_block_d(D),
        USE_SOFTCAP=bool(softcap), USE_WINDOW=bool(window), IEEE_F32=q.dtype == torch.float32,
        # The merge's tiles depend on the group only, so eager decodes whose split count
        # changes with the context compile no new variants.
        FP8=fp8, FUSED_MERGE=fused and not direct, PDL=pdl.enabled(q),
        BLOCK_GM=max(2, triton.next_power_of_2(group)), BLOCK_SM=merge_block_sm(group, D),
        EARLY=pdl.early_trigger(q, "attn"),
        num_warps=_num_warps(D, _elt_bytes(q, k_cache)), num_stages=_STAGES,
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


# ----- prefill ------------------------------------------------------------------------------


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
        k = _load_kv_tile(k_cache_ptr, bt_row, pos, pmask, offs_d, dmask, kvh, block_size,
                          stride_kn, stride_kb, stride_kh).to(q.dtype)  # [BLOCK_N, BLOCK_D]
        s = _scores(q, k, scale, softcap, USE_SOFTCAP, IEEE_F32)  # [BLOCK_M, BLOCK_N]
        visible = (pos[None, :] <= qpos[:, None]) & pmask[None, :]
        if USE_WINDOW:
            visible = visible & (pos[None, :] > qpos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        v = _load_kv_tile(v_cache_ptr, bt_row, pos, pmask, offs_d, dmask, kvh, block_size,
                          stride_vn, stride_vb, stride_vh).to(q.dtype)
        m_i, l_i, acc = _online_softmax_step(s, m_i, l_i, acc, v, IEEE_F32)
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
    return fit_tiles(block_m, 64, _block_d(head_dim), elt_bytes, shrink_m=True)


def fit_tiles(block_m: int, block_n: int, block_d: int, elt_bytes: int,
              shrink_m: bool) -> Tuple[int, int]:
    """Halve BLOCK_N, then (if allowed) BLOCK_M, down to 16, until the planned shared
    memory -- Q, ``_STAGES`` pipelined K and V tiles, P -- fits ``_SMEM_BUDGET``."""
    def smem(m: int, n: int) -> int:
        return elt_bytes * (m * block_d + _STAGES * 2 * n * block_d + m * n)

    while block_n > 16 and smem(block_m, block_n) > _SMEM_BUDGET:
        block_n //= 2
    while shrink_m and block_m > 16 and smem(block_m, block_n) > _SMEM_BUDGET:
        block_m //= 2
    return block_m, block_n


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
    _check_attention(q, k_cache, v_cache, block_tables, seq_lens, B)
    if query_start_loc.dim() != 1 or query_start_loc.shape[0] != B + 1:
        raise ValueError(f"query_start_loc {tuple(query_start_loc.shape)} must be [B+1={B + 1}]")
    _check_dtypes(query_start_loc=(query_start_loc, _INDEX_DTYPES))
    _check_same_device(q, query_start_loc)
    ks, vs, fp8 = _scale_args(k_cache, k_scale, v_scale)
    if out is None:
        out = torch.zeros_like(q)
    out = _check_out(q, out)
    T, H, D = q.shape
    if B == 0 or T == 0 or max_query_len <= 0:
        return out
    bm, bn = prefill_config(max_query_len, D, _elt_bytes(q, k_cache), _interpreting(q))
    window = int(sliding_window) if sliding_window else 0
    grid = (triton.cdiv(max_query_len, bm), H, B)
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, block_tables, query_start_loc, seq_lens, ks, vs,
        float(scale), float(softcap or 0.0), window, k_cache.shape[1], D,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        *k_cache.stride()[:3], *v_cache.stride()[:3],
        GROUP=H // k_cache.shape[2], BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=_block_d(D),
        USE_SOFTCAP=bool(softcap), USE_WINDOW=bool(window), IEEE_F32=q.dtype == torch.float32,
        FP8=fp8, num_warps=_num_warps(D, _elt_bytes(q, k_cache)), num_stages=_STAGES,
    )
    return out


# ----- input checks (host side, no device sync) ---------------------------------------------


def _block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))  # tl.dot needs K >= 16


def _num_warps(head_dim: int, elt_bytes: int) -> int:
    """8 warps once a K/V row is 256 bytes or more: with 4, ptxas spills the gathered
    tiles' addresses and the accumulator at 255 registers (checked for sm_90a)."""
    return 8 if _block_d(head_dim) * elt_bytes >= 256 else 4


def _elt_bytes(q: torch.Tensor, cache: torch.Tensor) -> int:
    return max(q.element_size(), cache.element_size())


def _interpreting(t: torch.Tensor) -> bool:
    """Off CUDA, only Triton's interpreter can run these kernels."""
    return t.device.type != "cuda"


def _check_caches(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} / v_cache {tuple(v_cache.shape)} "
                         "must both be [N, bs, Hkv, D]")
    _check_dtypes(k_cache=(k_cache, _CACHE_DTYPES), v_cache=(v_cache, _CACHE_DTYPES))
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"k_cache {k_cache.dtype} and v_cache {v_cache.dtype} differ in dtype")
    _check_inner_contiguous(k_cache=k_cache, v_cache=v_cache)


def _scale_args(k_cache: torch.Tensor, k_scale: Optional[torch.Tensor],
                v_scale: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor, bool]:
    """``(k_scale, v_scale, fp8)`` kernel arguments: an FP8 cache needs both scales as
    one float32 each on its device; other caches take none (the cache itself stands in
    for the pointers, which the kernels then never read)."""
    fp8 = k_cache.dtype == _FP8
    if not fp8:
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"k_scale / v_scale are for FP8 caches, not {k_cache.dtype}")
        return k_cache, k_cache, False
    for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
        if t is None or t.numel() != 1 or t.dtype != torch.float32:
            raise ValueError(f"an FP8 cache needs {name} as one float32 element, got "
                             f"{None if t is None else (tuple(t.shape), t.dtype)}")
    _check_same_device(k_cache, k_scale, v_scale)
    return k_scale, v_scale, True


def _check_attention(q, k_cache, v_cache, block_tables, seq_lens, batch: int) -> None:
    """What decode and prefill share: q / cache shapes and GQA, table and length shapes,
    dtypes, unit stride along D, one device."""
    _check_caches(k_cache, v_cache)
    if q.dim() != 3 or q.shape[2] != k_cache.shape[3] or q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} must be [T, H, D] with H a multiple of the "
                         f"cache's Hkv and D its head dim; cache {tuple(k_cache.shape)}")
    if block_tables.dim() != 2 or block_tables.shape[0] != batch:
        raise ValueError(f"block_tables {tuple(block_tables.shape)} must be [B={batch}, M]")
    if seq_lens.dim() != 1 or seq_lens.shape[0] != batch:
        raise ValueError(f"seq_lens {tuple(seq_lens.shape)} must be [B={batch}]")
    _check_dtypes(q=(q, _FLOAT_DTYPES), block_tables=(block_tables, _INDEX_DTYPES),
                  seq_lens=(seq_lens, _INDEX_DTYPES))
    _check_inner_contiguous(q=q)
    if block_tables.shape[1] and block_tables.stride(1) != 1:
        raise ValueError("block_tables rows must be contiguous")
    if not seq_lens.is_contiguous():
        raise ValueError("seq_lens must be contiguous")
    _check_same_device(q, k_cache, v_cache, block_tables, seq_lens)


def _check_out(q: torch.Tensor, out: Optional[torch.Tensor]) -> torch.Tensor:
    if out is None:
        return torch.empty_like(q)
    if out.shape != q.shape or out.dtype != q.dtype:
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} must match q "
                         f"{tuple(q.shape)} {q.dtype}")
    _check_inner_contiguous(out=out)
    _check_same_device(q, out)
    return out


def _check_dtypes(**named) -> None:
    for name, (t, allowed) in named.items():
        if t.dtype not in allowed:
            raise ValueError(f"{name} has dtype {t.dtype}; expected one of {allowed}")


def _check_inner_contiguous(**named) -> None:
    """The kernels take any outer strides but index the last dim with unit stride."""
    for name, t in named.items():
        if t.numel() and t.stride(-1) != 1:
            raise ValueError(f"{name} must have unit stride along its last dim")


def _check_same_device(*tensors: torch.Tensor) -> None:
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"all paged-attention inputs must be on one device; got {devices}")

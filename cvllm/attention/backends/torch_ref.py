"""Plain-torch paged attention: the CPU backend and the reference the kernels are checked
against.

Stateless (``interface.AttentionBackend``); the attention layer (``layers/attention.py``)
calls ``forward`` once per layer per step with that layer's ``KVCache`` (owned by the
worker), the step's ``AttentionMetadata`` (built by the worker) and its
``AttentionParams``. The batch is split on the host, without a device sync: the leading
decode sequences run through a one-query path, the rest are padded to ``[B, Qmax, Lmax]``
and run as one masked SDPA call. Groups of sequences are sized so the float32 scores stay
under ``MAX_ELEMS`` elements; a sequence too long for that alone is cut into query
chunks. Scores and softmax are float32 in any dtype. Non-causal layers (encoder
attention) attend over each sequence's own tokens of the step, with no cache.

FP8 caches (``--fp8-kvcache``, ``attention/kv_cache.py``): writes store
``clamp(x / scale, +-448)`` in e4m3 and gathers dequantize to float32 (``x * scale``),
with the per-tensor scales the ``KVCache`` carries (calibrated at its first write) -- the
same math as the Triton kernels and ``kernels/reference/paged_attention.py``, so the CPU engine supports
the flag too.
"""

from __future__ import annotations

from typing import Iterator, List, Optional, Tuple

import torch
import torch.nn.functional as F

from cvllm.attention.interface import AttentionBackend, AttentionCapabilities, AttentionParams
from cvllm.attention.kv_cache import KVCache, calibrate_kv_scales
from cvllm.attention.metadata import AttentionMetadata, RopeInputs
from cvllm.kernels.reference.paged_attention import dequantize_kv_ref, quantize_kv_ref

MAX_ELEMS = 1 << 26
"""Float32 elements (scores + gathered K/V) one group may materialise: 256 MiB."""


def write_kv(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    cache: KVCache,  # [N, bs, Hkv, D] each
    slot_mapping: torch.Tensor,  # [T] int64, no padding slots
) -> None:
    """Store this step's keys and values at their cache slots (FP8: quantized)."""
    k_cache, v_cache = cache.k, cache.v
    if k.dtype == k_cache.dtype and v.dtype == v_cache.dtype:  # plain stores: the usual case
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k)  # [N*bs, Hkv, D]
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v)
        return
    calibrate_kv_scales(cache, k, v)  # first real write of an FP8 cache only
    for x, c, scale in ((k, k_cache, cache.k_scale), (v, v_cache, cache.v_scale)):
        if x.dtype == c.dtype:  # a plain store (the usual case: no cast to dispatch)
            c.view(-1, *c.shape[2:]).index_copy_(0, slot_mapping, x)
            continue
        xq = quantize_kv_ref(x, c.dtype, scale)  # [T, Hkv, D]
        if xq.element_size() == 1:  # CPU index_copy_ has no float8 kernel: copy the bytes
            c, xq = c.view(torch.uint8), xq.view(torch.uint8)
        c.view(-1, *c.shape[2:]).index_copy_(0, slot_mapping, xq)  # [N*bs, Hkv, D]


def forward(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    kv_cache: Optional[KVCache],  # [N, bs, Hkv, D] each; None for non-causal layers
    meta: AttentionMetadata,
    params: AttentionParams,
    rope: Optional[RopeInputs] = None,  # never given: no fused_rope
    out: Optional[torch.Tensor] = None,  # never given: no takes_out
) -> torch.Tensor:
    """Write K/V, then attend every sequence's queries over its cached context, causally
    (non-causal layers: over this step's own tokens, see ``_encoder``). Returns
    ``[T, H, D]``; rows of padding tokens (past ``meta.num_tokens``) are zero."""
    if not params.causal:
        return _encoder(q, k, v, meta, params)
    n, k_cache, v_cache = meta.num_tokens, kv_cache.k, kv_cache.v
    if q.shape[1] % k_cache.shape[2] != 0:
        raise ValueError(f"{q.shape[1]} query heads do not group over {k_cache.shape[2]} KV heads")
    if n == q.shape[0] == meta.slot_mapping.shape[0]:
        write_kv(k, v, kv_cache, meta.slot_mapping)
    else:
        write_kv(k[:n], v[:n], kv_cache, meta.slot_mapping[:n])
    if n == q.shape[0] and meta.num_decodes == meta.num_seqs:
        plan = _decode_plan(meta, q, k_cache, params.sliding_window)
        if len(plan) == 1:  # the usual decode step: one SDPA call's output is the answer
            _, _, _, L, visible, run = plan[0]
            if (run is not None and visible is None and params.softcap is None
                    and q.dtype == k_cache.dtype == v_cache.dtype == torch.float32):
                return _decode_run(q, k_cache, v_cache, run * k_cache.shape[1], L, params.scale)
            return _decode_group(q, kv_cache, plan[0], params)
    out = torch.empty_like(q)  # [T, H, D]
    if n < q.shape[0]:
        out[n:].zero_()
    _decode(q, kv_cache, meta, params, out)
    _prefill(q, kv_cache, meta, params, out)
    return out


def _encoder(q, k, v, meta: AttentionMetadata, params: AttentionParams) -> torch.Tensor:
    """Non-causal attention: each sequence's queries over its own tokens of this step
    (``query_start_loc``), every key visible, no cache -> ``[T, H, D]``."""
    out = torch.zeros_like(q)  # [T, H, D]: padding rows stay zero
    qsl = meta.query_start_loc_cpu
    for b in range(meta.num_seqs):
        t0, t1 = int(qsl[b]), int(qsl[b + 1])
        out[t0:t1] = _attend_visible(q[None, t0:t1], k[None, t0:t1], v[None, t0:t1], None,
                                     params)[0]
    return out


def _decode(q, kv: KVCache, meta: AttentionMetadata, opts: AttentionParams,
            out: torch.Tensor) -> None:
    """Leading one-token sequences: sequence ``b`` owns token ``b``."""
    if meta.num_decodes == 0:
        return
    for group in _decode_plan(meta, q, kv.k, opts.sliding_window):
        out[group[0] : group[1]] = _decode_group(q, kv, group, opts)


def _decode_run(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, t0: int, L: int,
                scale: float) -> torch.Tensor:
    """One float32 sequence whose blocks are consecutive, every key visible: SDPA over
    views of cache rows ``t0 .. t0 + L`` -> ``[1, H, D]``. What ``_decode_group`` computes
    there, in the fewest ops (a small model's decode step is mostly per-op cost)."""
    kk, vv = (c.view(-1, *c.shape[2:])[t0:t0 + L].transpose(0, 1).unsqueeze(0)
              for c in (k_cache, v_cache))  # [1, Hkv, L, D] each
    # 4-D: SDPA takes its fused CPU kernel (3-D inputs go to the slower math path)
    o = F.scaled_dot_product_attention(q.unsqueeze(2), kk, vv, scale=float(scale),
                                       enable_gqa=True)  # [1, H, 1, D]
    return o[:, :, 0]  # [1, H, D]


def _decode_group(q, kv: KVCache, group: tuple, opts: AttentionParams) -> torch.Tensor:
    """One planned group of decode sequences -> ``[Bg, H, D]``."""
    b0, b1, idx, L, visible, run = group
    if run is not None and kv.k.dtype != torch.float8_e4m3fn:
        # One sequence whose blocks are consecutive: its K/V are views of the cache.
        t0 = run * kv.k.shape[1]
        kk, vv = (c.view(-1, *c.shape[2:])[t0:t0 + L].unsqueeze(0)
                  for c in (kv.k, kv.v))  # [1, L, Hkv, D] each
    else:
        kk = _gather_rows(kv.k, idx, b1 - b0, L, kv.k_scale)
        vv = _gather_rows(kv.v, idx, b1 - b0, L, kv.v_scale)
    return _attend_visible(q[b0:b1].unsqueeze(1), kk, vv, visible, opts)[:, 0]  # [Bg, H, D]


def _decode_plan(meta: AttentionMetadata, q: torch.Tensor, k_cache: torch.Tensor,
                 window: Optional[int]) -> list:
    """``[(b0, b1, block_ids [Bg*nb], L, visible [Bg, 1, L] or None, run)]`` of the
    decode groups. The same for every layer of the step, so built once and kept in
    ``meta.host_cache`` (a layer's per-step ops, not its FLOPs, dominate small models on
    the CPU). ``visible`` is None when every key of the padded context is visible: then
    SDPA takes its unmasked path. ``run``: for a group of one sequence whose blocks are
    consecutive ids (a lone stream's usually are), the first block id: attention then
    reads the cache in place instead of gathering it (CPU block tables only: a host read;
    the default model's decode step: about 0.6 ms of 15)."""
    h, kv_row, bs = q.shape[1], k_cache.shape[2] * k_cache.shape[3], k_cache.shape[1]
    window = int(window) if window else None
    key = ("torch_ref.decode", h, kv_row, bs, window, MAX_ELEMS)
    plan = meta.host_cache.get(key)
    if plan is not None:
        return plan
    nd, plan = meta.num_decodes, []
    seq_lens = meta.seq_lens_cpu[:nd]
    for b0, b1 in _plan_groups(seq_lens, [1] * nd, h, kv_row):
        L = int(seq_lens[b0:b1].max())
        nb = -(-L // bs)
        _check_blocks(meta.block_tables, nb, L)
        idx = meta.block_tables[b0:b1, :nb].reshape(-1)  # [Bg*nb]
        visible = None
        if int(seq_lens[b0:b1].min()) < L or (window is not None and L > window):
            kpos = torch.arange(L, device=idx.device)  # [L]
            qp = (meta.seq_lens[b0:b1].long() - 1).view(-1, 1, 1)  # [Bg, 1, 1]
            visible = _visible(kpos, qp, window)  # [Bg, 1, L]
        run = None
        if b1 - b0 == 1 and idx.device.type == "cpu":
            ids = idx.tolist()
            if ids == list(range(ids[0], ids[0] + nb)):
                run = ids[0]
        plan.append((b0, b1, idx, L, visible, run))
    meta.host_cache[key] = plan
    return plan


def _prefill(q, kv: KVCache, meta: AttentionMetadata, opts: AttentionParams,
             out: torch.Tensor) -> None:
    """Sequences after the decodes, in padded groups (one sequence: unpadded, chunked)."""
    nd, B = meta.num_decodes, meta.num_seqs
    if nd == B:
        return
    h, d, hkv = q.shape[1], q.shape[2], kv.k.shape[2]
    qsl = meta.query_start_loc_cpu
    qlens = (qsl[nd + 1 :] - qsl[nd:-1]).tolist()
    for g0, g1 in _plan_groups(meta.seq_lens_cpu[nd:], qlens, h, hkv * d):
        b0, b1 = nd + g0, nd + g1
        if b1 - b0 == 1:
            _prefill_one(q, kv, meta, b0, opts, out)
        else:
            _prefill_group(q, kv, meta, b0, b1, opts, out)


def _prefill_one(
    q, kv: KVCache, meta: AttentionMetadata, b: int, opts: AttentionParams, out: torch.Tensor
) -> None:
    t0, t1 = int(meta.query_start_loc_cpu[b]), int(meta.query_start_loc_cpu[b + 1])
    seq_len = int(meta.seq_lens_cpu[b])
    ctx = seq_len - (t1 - t0)  # tokens cached before this step
    h, kv_row = q.shape[1], kv.k.shape[2] * kv.k.shape[3]
    # Query chunk size so that scores + K/V of the full context fit the budget.
    chunk = max(1, (MAX_ELEMS - 2 * seq_len * kv_row) // max(h * seq_len, 1))
    bt = meta.block_tables[b : b + 1]
    for i0 in range(0, t1 - t0, chunk):
        i1 = min(i0 + chunk, t1 - t0)
        L = ctx + i1  # later keys are masked for every query of this chunk
        kk, vv = _gather_kv(kv, bt, L)  # [1, L, Hkv, D] each
        qpos = torch.arange(ctx + i0, ctx + i1, device=q.device).unsqueeze(0)  # [1, Qc]
        out[t0 + i0 : t0 + i1] = _attend(q[t0 + i0 : t0 + i1].unsqueeze(0), kk, vv, qpos, opts)[0]


def _prefill_group(
    q, kv: KVCache, meta: AttentionMetadata, b0: int, b1: int, opts: AttentionParams,
    out: torch.Tensor
) -> None:
    qsl_cpu = meta.query_start_loc_cpu
    t0, t1 = int(qsl_cpu[b0]), int(qsl_cpu[b1])
    Bg, h, d = b1 - b0, q.shape[1], q.shape[2]
    Qm = int((qsl_cpu[b0 + 1 : b1 + 1] - qsl_cpu[b0:b1]).max())
    L = int(meta.seq_lens_cpu[b0:b1].max())
    qlens = meta.query_lens[b0:b1].long()  # [Bg]
    dev = q.device
    seq_idx = torch.repeat_interleave(
        torch.arange(Bg, device=dev), qlens, output_size=t1 - t0
    )  # [Tg]
    first_tok = meta.query_start_loc[b0:b1].long() - t0  # [Bg]
    pad_idx = seq_idx * Qm + (torch.arange(t1 - t0, device=dev) - first_tok[seq_idx])  # [Tg]
    q_pad = (
        q.new_zeros(Bg * Qm, h, d).index_copy_(0, pad_idx, q[t0:t1]).view(Bg, Qm, h, d)
    )  # [Bg, Qm, H, D]
    ctx = meta.seq_lens[b0:b1].long() - qlens  # [Bg]
    qpos = ctx.unsqueeze(1) + torch.arange(Qm, device=dev)  # [Bg, Qm]
    bt = meta.block_tables[b0:b1]
    kk, vv = _gather_kv(kv, bt, L)  # [Bg, L, Hkv, D] each
    o = _attend(q_pad, kk, vv, qpos, opts)  # [Bg, Qm, H, D]
    out[t0:t1] = o.reshape(Bg * Qm, h, d).index_select(0, pad_idx)


def _gather_kv(kv: KVCache, block_tables: torch.Tensor,
               L: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The first ``L`` cached keys and values of each row's sequence: ``[B, L, Hkv, D]``
    each."""
    nb = -(-L // kv.k.shape[1])
    _check_blocks(block_tables, nb, L)
    idx = block_tables[:, :nb].reshape(-1)  # [B*nb]
    B = block_tables.shape[0]
    return _gather_rows(kv.k, idx, B, L, kv.k_scale), _gather_rows(kv.v, idx, B, L, kv.v_scale)


def _check_blocks(block_tables: torch.Tensor, nb: int, L: int) -> None:
    if nb > block_tables.shape[1]:
        raise ValueError(
            f"block_tables has {block_tables.shape[1]} columns, {nb} needed for {L} tokens"
        )


def _gather_rows(cache: torch.Tensor, idx: torch.Tensor, B: int, L: int,
                 scale: Optional[torch.Tensor]) -> torch.Tensor:
    """Blocks ``idx [B*nb]`` (``nb`` per row) cut to their first ``L`` tokens:
    ``[B, L, Hkv, D]``, dequantized to float32 with ``scale`` for FP8 caches."""
    g = cache.index_select(0, idx)  # [B*nb, bs, Hkv, D]
    if g.dtype == torch.float8_e4m3fn:
        g = dequantize_kv_ref(g, scale)  # float32
    return g.view(B, -1, cache.shape[2], cache.shape[3])[:, :L]  # [B, L, Hkv, D]


def _visible(kpos: torch.Tensor, qp: torch.Tensor, window: Optional[int]) -> torch.Tensor:
    """Key ``j`` is visible to a query at ``qp`` iff ``j <= qp`` (and within the window)."""
    visible = kpos <= qp  # broadcast of kpos [L] and qp [..., 1]
    if window is not None:
        visible &= kpos > qp - window
    return visible


def _attend(
    q: torch.Tensor,  # [B, Q, H, D]
    k: torch.Tensor,  # [B, L, Hkv, D]
    v: torch.Tensor,  # [B, L, Hkv, D]
    qpos: torch.Tensor,  # [B, Q] position of each query; key j is visible iff j <= qpos
    opts: AttentionParams,
) -> torch.Tensor:
    """Causally masked attention in float32 -> ``[B, Q, H, D]`` in q's dtype."""
    kpos = torch.arange(k.shape[1], device=q.device)
    visible = _visible(kpos, qpos.unsqueeze(-1), opts.sliding_window)  # [B, Q, L]
    return _attend_visible(q, k, v, visible, opts)


def _attend_visible(
    q: torch.Tensor,  # [B, Q, H, D]
    k: torch.Tensor,  # [B, L, Hkv, D]
    v: torch.Tensor,  # [B, L, Hkv, D]
    visible: Optional[torch.Tensor],  # [B, Q, L] bool; None: every key visible
    opts: AttentionParams,
) -> torch.Tensor:
    """Attention in float32 -> ``[B, Q, H, D]`` in q's dtype. Without a softcap this
    is one SDPA call (its fused CPU / CUDA kernels are several times faster than matmuls on
    permuted views); a softcap must act on the raw scores, so it takes explicit matmuls."""
    qf, kf, vf = ((x if x.dtype == torch.float32 else x.float()).transpose(1, 2)
                  for x in (q, k, v))  # [B, heads, Q or L, D]
    if opts.softcap is None:
        mask = None if visible is None else visible.unsqueeze(1)  # [B, 1, Q, L]
        o = F.scaled_dot_product_attention(
            qf, kf, vf, attn_mask=mask, scale=opts.scale, enable_gqa=True
        )  # [B, H, Q, D]
    else:
        o = _attend_softcap(qf, kf, vf, visible, opts)
    o = o.transpose(1, 2)
    return o if o.dtype == q.dtype else o.to(q.dtype)


def _attend_softcap(qf, kf, vf, visible: Optional[torch.Tensor], opts: AttentionParams) -> torch.Tensor:
    B, H, Q, D = qf.shape
    Hkv, L = kf.shape[1], kf.shape[2]
    G = H // Hkv
    qg = qf.reshape(B, Hkv, G * Q, D)  # [B, Hkv, G*Q, D]: heads h = kv * G + g
    s = torch.matmul(qg, kf.transpose(2, 3)).view(B, Hkv, G, Q, L) * opts.scale  # [B, Hkv, G, Q, L]
    s = torch.tanh(s / opts.softcap) * opts.softcap
    if visible is not None:
        s.masked_fill_(~visible[:, None, None], float("-inf"))
    p = torch.softmax(s, dim=-1).view(B, Hkv, G * Q, L)
    return torch.matmul(p, vf).view(B, H, Q, D)  # [B, H, Q, D]


def _plan_groups(seq_lens, query_lens: List[int], h: int, kv_row: int) -> Iterator[Tuple[int, int]]:
    """Contiguous sequence groups whose padded scores + K/V fit ``MAX_ELEMS``."""
    b0, n = 0, len(query_lens)
    while b0 < n:
        b1, qm, lm = b0 + 1, int(query_lens[b0]), int(seq_lens[b0])
        while b1 < n:
            q2, l2 = max(qm, int(query_lens[b1])), max(lm, int(seq_lens[b1]))
            if (b1 + 1 - b0) * (h * q2 * l2 + 2 * l2 * kv_row) > MAX_ELEMS:
                break
            b1, qm, lm = b1 + 1, q2, l2
        yield b0, b1
        b0 = b1


class TorchRefAttentionBackend(AttentionBackend):
    """The backend ``attention/backend.py`` hands to attention layers on the CPU. Its
    decode plan reads the metadata's host arrays, so no CUDA graph may capture it."""

    name = "torch_ref"
    capabilities = AttentionCapabilities(fp8_cache=True, non_causal=True)
    forward = staticmethod(forward)

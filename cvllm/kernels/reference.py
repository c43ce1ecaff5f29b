"""Plain-torch references of the Triton kernels (DESIGN rule 7).

Each function here is the CPU path of its op or the oracle its Triton kernel is tested
against; same arguments, same results up to float rounding. No state, no device logic;
written for obviousness, not speed. Sections: fused MoE, gated DeltaNet, paged attention,
RMSNorm, all-reduce, rotary embedding, gated activations, sampling.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

MOE_ACTIVATIONS = ("silu", "gelu")


def moe_act_and_mul(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """``act(gate) * up`` of a fused ``[.., 2I]`` expert projection (gate first)."""
    inter = gate_up.shape[-1] // 2
    gate, up = gate_up[..., :inter], gate_up[..., inter:]
    if activation == "silu":
        return F.silu(gate) * up  # [.., I]
    if activation == "gelu":
        return F.gelu(gate) * up  # [.., I]
    raise ValueError(f"unsupported MoE activation {activation!r}; supported: {MOE_ACTIVATIONS}")


def sort_tokens_by_expert(topk_ids: torch.Tensor, num_experts: int):
    """Group the ``T*K`` (token, slot) pairs by expert.

    Returns ``order [T*K]`` (flat pair indices, stable-sorted by expert, so each expert's
    tokens keep their order) and ``counts [E]`` (pairs per expert)."""
    flat = topk_ids.reshape(-1)  # [T*K]
    order = torch.argsort(flat, stable=True)  # [T*K]
    counts = torch.bincount(flat, minlength=num_experts)  # [E]
    return order, counts


def fused_moe_ref(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
) -> torch.Tensor:
    """Mixture of experts: ``out[t] = sum_k w[t,k] * W2[e] act(W13[e] x[t])``, ``e = ids[t,k]``.

    ``hidden [T, H]``, ``w13 [E, 2I, H]`` (gate rows then up rows), ``w2 [E, H, I]``,
    ``topk_weights [T, K]``, ``topk_ids [T, K]`` -> ``[T, H]`` in ``hidden``'s dtype.
    Tokens are sorted by expert and each expert that received tokens does one matmul over
    all of them (a loop over experts, not over tokens), like the grouped GEMM on the GPU.
    """
    num_tokens, top_k = topk_ids.shape
    order, counts = sort_tokens_by_expert(topk_ids, w13.shape[0])
    token_of = order // top_k  # [T*K] source token of each sorted pair
    sorted_out = hidden.new_empty(order.numel(), w2.shape[1])  # [T*K, H]
    start = 0
    for expert, count in enumerate(counts.tolist()):
        if count == 0:
            continue
        rows = token_of[start : start + count]
        x = hidden[rows]  # [n, H]
        inter = moe_act_and_mul(x @ w13[expert].t(), activation)  # [n, I]
        sorted_out[start : start + count] = inter @ w2[expert].t()  # [n, H]
        start += count
    weights = topk_weights.reshape(-1)[order].to(torch.float32)  # [T*K]
    weighted = sorted_out.to(torch.float32) * weights[:, None]  # [T*K, H]
    out = torch.zeros(num_tokens, w2.shape[1], dtype=torch.float32, device=hidden.device)
    out.index_add_(0, token_of, weighted)  # [T, H]
    return out.to(hidden.dtype)


# ----------------------------------------------------------------- gated DeltaNet
# Qwen3-Next / Qwen3.5 linear attention, one sequence at a time: the oracles of the
# batched (varlen, chunked) forms in ``layers/gated_deltanet.py``.

def l2norm_ref(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim (FLA's and transformers' form)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def causal_conv1d_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    conv_state: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv of one sequence, continuing from its conv state.

    ``x [L, C]``, ``weight [C, K]``, ``conv_state [C, K-1]`` (the K-1 inputs before ``x``;
    None = zeros, a sequence's start) -> ``(out [L, C], new_state [C, K-1])``."""
    length, channels = x.shape
    width = weight.shape[1]
    if conv_state is None:
        conv_state = x.new_zeros(channels, width - 1)
    ext = torch.cat([conv_state.to(x.dtype), x.t()], dim=1)  # [C, K-1+L]
    out = torch.zeros(channels, length, dtype=torch.float32, device=x.device)
    for j in range(width):  # tap j reads the input j - (K-1) steps back
        out += weight[:, j : j + 1].float() * ext[:, j : j + length].float()
    if bias is not None:
        out += bias.float()[:, None]
    if activation in ("silu", "swish"):
        out = F.silu(out)
    elif activation is not None:
        raise ValueError(f"unsupported conv activation {activation!r}")
    return out.t().to(x.dtype), ext[:, length:].clone()  # [L, C], [C, K-1]


def gated_delta_rule_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule of one sequence, token by token, in float32.

    ``q``/``k [L, Hk, Dk]``, ``v [L, Hv, Dv]``, ``g`` (log decay, <= 0) / ``beta [L, Hv]``,
    ``initial_state [Hv, Dk, Dv]`` (None = zeros) -> ``(out [L, Hv, Dv], state [Hv, Dk, Dv])``
    float32. Per token: ``S = exp(g) S``; ``S += k (beta (v - S^T k))^T``; ``o = S^T q``,
    with ``q`` scaled by ``Dk^-1/2``; each q/k head serves ``Hv/Hk`` consecutive v heads."""
    length, num_k_heads, head_k = k.shape
    num_v_heads, head_v = v.shape[1:]
    rep = num_v_heads // num_k_heads
    q, k = (t.float().repeat_interleave(rep, dim=1) for t in (q, k))  # [L, Hv, Dk]
    if use_qk_l2norm:
        q, k = l2norm_ref(q), l2norm_ref(k)
    q = q * head_k**-0.5
    v, g, beta = v.float(), g.float(), beta.float()
    state = (torch.zeros(num_v_heads, head_k, head_v, device=v.device)
             if initial_state is None else initial_state.float().clone())
    out = torch.empty(length, num_v_heads, head_v, device=v.device)
    for t in range(length):
        state = state * g[t].exp()[:, None, None]
        predicted = torch.einsum("hkv,hk->hv", state, k[t])  # [Hv, Dv]
        delta = (v[t] - predicted) * beta[t][:, None]  # [Hv, Dv]
        state = state + k[t][:, :, None] * delta[:, None, :]
        out[t] = torch.einsum("hkv,hk->hv", state, q[t])
    return out, state


def rms_norm_gated_ref(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """``weight * rmsnorm(x) * silu(gate)`` over the last dim (norm before gate), rounded
    to ``x``'s dtype where transformers rounds."""
    dtype = x.dtype
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    return (weight * normed * F.silu(gate.float())).to(dtype)


# ----------------------------------------------------------------- paged attention
# Oracles of ``kernels/paged_attention.py``, one sequence at a time, float32, K/V heads
# repeated for GQA. Conventions shared with the kernels: a cache is ``[N, bs, Hkv, D]``
# and token slot ``s`` lives at ``cache[s // bs, s % bs]``; ``block_tables[b, j]`` is the
# j-th block of sequence b; sequence b's ``q_len`` queries sit at positions
# ``seq_len - q_len .. seq_len - 1`` and see key j iff ``j <= pos`` (and
# ``j > pos - sliding_window``).

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
        k = dequantize_kv_ref(gather_context(k_cache, block_tables[b], seq_len), k_scale)
        v = dequantize_kv_ref(gather_context(v_cache, block_tables[b], seq_len), v_scale)
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
        k = dequantize_kv_ref(gather_context(k_cache, block_tables[b], seq_len), k_scale)
        v = dequantize_kv_ref(gather_context(v_cache, block_tables[b], seq_len), v_scale)
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


# ----------------------------------------------------------------- RMSNorm
def rms_norm_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: Optional[torch.Tensor] = None,
    offset: bool = False,
):
    """``norm(x)``, or ``(norm(x + residual), x + residual)``, outputs in x's dtype: the
    add rounds to x's dtype and the norm is taken of the rounded sum (HF's decoder
    layers). ``offset=False`` (Llama): ``w * round(normed)``; ``offset=True`` (Gemma):
    ``normed * (1 + w)`` in float32, rounded once. Oracle of ``kernels/rmsnorm.py``."""
    if residual is not None:
        x = x + residual
        residual = x
    dtype = x.dtype
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if offset:
        out = (normed * (1.0 + weight.float())).to(dtype)
    else:
        out = (weight.float() * normed.to(dtype).float()).to(dtype)
    return out if residual is None else (out, residual)


# ----------------------------------------------------------------- all-reduce
def all_reduce_ref(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """The sum of every rank's tensor, in float32 in rank order, rounded once to the
    inputs' dtype. Oracle of ``kernels/allreduce.py`` without the norm."""
    acc = torch.zeros(parts[0].shape, dtype=torch.float32, device=parts[0].device)
    for p in parts:
        acc += p.float()
    return acc.to(parts[0].dtype)


def all_reduce_rms_norm_ref(parts: Sequence[torch.Tensor], residual: torch.Tensor,
                            weight: torch.Tensor, eps: float):
    """``rms_norm_ref(all_reduce_ref(parts), weight, eps, residual)``: what a rank gets
    from the all-reduce followed by the decoder's add + RMSNorm. Oracle of
    ``kernels/allreduce.py`` with the norm."""
    return rms_norm_ref(all_reduce_ref(parts), weight, eps, residual)


# ----------------------------------------------------------------- rotary embedding
def rotary_embedding_ref(
    positions: torch.Tensor,  # [T]
    query: torch.Tensor,  # [T, H*D] or [T, H, D]
    key: Optional[torch.Tensor],  # [T, Hkv*D] or [T, Hkv, D]
    cos_sin_cache: torch.Tensor,  # [max_pos, rot_dim] float32: cos half | sin half
    head_size: int,
    is_neox_style: bool = True,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Rotated copies of query / key (inputs untouched), in their dtype, with cos/sin cast
    to it first, as HF and ``layers/rotary.py`` do. The first ``rot_dim`` dims of each
    head rotate: neox pairs (i, i + rot_dim/2), GPT-J (2i, 2i+1). Oracle of
    ``kernels/rotary.py``."""
    rot_dim = cos_sin_cache.shape[-1]
    cos, sin = cos_sin_cache.index_select(0, positions.long()).chunk(2, dim=-1)  # [T, rot/2]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        heads = x.reshape(x.shape[0], -1, head_size)  # [T, heads, D]
        rot, rest = heads[..., :rot_dim], heads[..., rot_dim:]
        c, s = cos.unsqueeze(1).to(x.dtype), sin.unsqueeze(1).to(x.dtype)  # [T, 1, rot/2]
        if is_neox_style:
            x1, x2 = rot.chunk(2, dim=-1)
        else:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
        o1, o2 = x1 * c - x2 * s, x2 * c + x1 * s
        if is_neox_style:
            rot = torch.cat([o1, o2], dim=-1)
        else:
            rot = torch.stack([o1, o2], dim=-1).flatten(-2)  # [T, heads, rot_dim]
        return torch.cat([rot, rest], dim=-1).reshape(x.shape)

    return rotate(query), (rotate(key) if key is not None else None)


def rotary_write_kv_ref(
    positions: torch.Tensor,  # [T]
    query: torch.Tensor,  # [T, H*D] or [T, H, D]
    key: torch.Tensor,  # [T, Hkv*D] or [T, Hkv, D]
    value: torch.Tensor,  # same shape as key
    cos_sin_cache: torch.Tensor,  # [max_pos, rot_dim] float32
    head_size: int,
    is_neox_style: bool,
    k_cache: torch.Tensor,  # [N, bs, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [>= num_writes] int; -1 writes nothing
    num_writes: Optional[int] = None,
    k_scale: Optional[torch.Tensor] = None,
    v_scale: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Rotated copies of query / key (``rotary_embedding_ref``), with the rotated keys
    and the values of tokens ``0..num_writes-1`` written to the caches (``write_kv_ref``).
    Oracle of ``kernels/rotary.rotary_write_kv``."""
    q, k = rotary_embedding_ref(positions, query, key, cos_sin_cache, head_size, is_neox_style)
    n = positions.shape[0] if num_writes is None else num_writes
    T = positions.shape[0]
    k3, v3 = k.reshape(T, -1, head_size), value.reshape(T, -1, head_size)  # [T, Hkv, D]
    write_kv_ref(k3[:n], v3[:n], k_cache, v_cache, slot_mapping[:n], k_scale, v_scale)
    return q, k


# ----------------------------------------------------------------- gated activations
ACT_AND_MUL = ("silu", "gelu", "gelu_tanh")


def act_and_mul_ref(x: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """``act(x[.., :I]) * x[.., I:]`` in x's dtype (torch's per-op roundings). Oracle of
    ``kernels/activation.py``."""
    inter = x.shape[-1] // 2
    gate, up = x[..., :inter], x[..., inter:]
    if activation == "silu":
        return F.silu(gate) * up  # [.., I]
    if activation in ("gelu", "gelu_tanh"):
        approximate = "tanh" if activation == "gelu_tanh" else "none"
        return F.gelu(gate, approximate=approximate) * up  # [.., I]
    raise ValueError(f"unsupported activation {activation!r}; supported: {ACT_AND_MUL}")


# ----------------------------------------------------------------- batch-1 linear
def gemv_ref(x: torch.Tensor, weight: torch.Tensor,
             bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x @ weight^T (+ bias)`` summed in float32 and rounded once to x's dtype: the
    contract of ``kernels/gemv.gemv`` (one row of ``F.linear``)."""
    y = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    return y.to(x.dtype)


# ----------------------------------------------------------------- sampling
# Transcriptions of ``layers/sampler.py`` (its torch path is the semantic reference),
# in the calling conventions of ``kernels/sampling.py``.

def apply_penalties_ref(
    logits: torch.Tensor,  # [S, V] float32
    output_counts: torch.Tensor,  # [S, V] int: occurrences in the output
    prompt_mask: Optional[torch.Tensor],  # [S, V] bool: token in the prompt
    repetition_penalty: Optional[torch.Tensor],  # [S]
    frequency_penalty: Optional[torch.Tensor],  # [S]
    presence_penalty: Optional[torch.Tensor],  # [S]
) -> torch.Tensor:
    """Repetition (over prompt and output tokens: divide positive logits, multiply
    negative ones), then ``- frequency * count - presence * (count > 0)``; a new tensor."""
    if prompt_mask is not None and repetition_penalty is not None:
        seen = prompt_mask | (output_counts > 0)  # [S, V]
        rp = repetition_penalty.unsqueeze(1)  # [S, 1]
        logits = torch.where(seen, torch.where(logits > 0, logits / rp, logits * rp), logits)
    if frequency_penalty is not None and presence_penalty is not None:
        counts = output_counts.to(logits.dtype)  # [S, V]
        logits = (logits - frequency_penalty.unsqueeze(1) * counts
                  - presence_penalty.unsqueeze(1) * (counts > 0).to(logits.dtype))
    return logits.clone()


def sample_ref(
    logits: torch.Tensor,  # [S, V] float32, penalized
    temperature: torch.Tensor,  # [S] float32
    top_k: torch.Tensor,  # [S] int64; V = off
    top_p: torch.Tensor,  # [S] float32; 1 = off
    min_p: torch.Tensor,  # [S] float32; 0 = off
    is_greedy: torch.Tensor,  # [S] bool
    noise: torch.Tensor,  # [S, V] float32 Exp(1) draws
) -> torch.Tensor:
    """``[S]`` int64: greedy rows the argmax; the others ``argmax(probs / noise)`` after
    temperature -> top-k (by rank) -> top-p (smallest prefix whose mass reaches top_p,
    after top-k, the top token always kept, rows at 1 exempt) -> min-p (below
    ``min_p * max prob`` -> 0). Every stage runs; an off value makes it a no-op."""
    greedy = logits.argmax(dim=-1)  # [S]
    scaled = logits / temperature.unsqueeze(1)  # [S, V]
    sorted_logits, sorted_idx = scaled.sort(dim=-1, descending=True)  # [S, V]
    ranks = torch.arange(scaled.shape[-1], device=logits.device).unsqueeze(0)  # [1, V]
    sorted_logits = sorted_logits.masked_fill(ranks >= top_k.unsqueeze(1), float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # [S, V]
    drop = (mass_before >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    scaled = torch.empty_like(scaled).scatter_(-1, sorted_idx, sorted_logits)
    probs = scaled.softmax(dim=-1)  # [S, V]
    floor = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)  # [S, 1]
    probs = probs.masked_fill(probs < floor, 0.0)
    race = (probs / noise.clamp_min(torch.finfo(noise.dtype).tiny)).argmax(dim=-1)  # [S]
    return torch.where(is_greedy, greedy, race)

"""Plain-torch references of the Triton kernels (DESIGN rule 7).

Each function here is the CPU path of its op and the oracle its Triton kernel is tested
against; same arguments, same results up to float rounding. No state, no device logic.
"""

from __future__ import annotations

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

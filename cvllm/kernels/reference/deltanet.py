"""Gated DeltaNet (Qwen3-Next / Qwen3.5 linear attention), one sequence at a time: the
oracles of the batched (varlen, chunked) forms in ``layers/gated_deltanet.py``."""

from __future__ import annotations

import torch
import torch.nn.functional as F


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

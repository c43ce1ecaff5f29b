"""Reference of the fused MoE kernels (``kernels/fused_moe.py``), also the CPU path of
``quantization/unquantized.UnquantizedMoEMethod`` and the GGUF MoE method."""

from __future__ import annotations

import torch

from cvllm.kernels.reference.linear import act_and_mul_ref

MOE_ACTIVATIONS = ("silu", "gelu")

def moe_act_and_mul(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """``act(gate) * up`` of a fused ``[.., 2I]`` expert projection (gate first)."""
    if activation not in MOE_ACTIVATIONS:
        raise ValueError(f"unsupported MoE activation {activation!r}; supported: "
                         f"{MOE_ACTIVATIONS}")
    return act_and_mul_ref(gate_up, activation)  # [.., I]


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

"""The sparse MoE block of the Qwen MoE families (Qwen2-MoE, Qwen3-MoE, Qwen3-Next,
Qwen3.5-MoE), as in transformers' ``Qwen2MoeSparseMoeBlock``: a softmax router
(``mlp.gate``) picks ``num_experts_per_tok`` experts (weights renormalised when the
family says), the routed experts run as one ``FusedMoE``, and a shared expert
(``shared_expert_intermediate_size``, a gated MLP) is added, scaled by
``sigmoid(shared_expert_gate(x))``; Qwen3-MoE has none.

Built by the model classes in place of a decoder layer's dense MLP (``is_sparse_layer``),
on every rank; the experts' weights are this rank's slice (``layers/moe.py``).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from cvllm.config import ModelConfig
from cvllm.layers.linear import ReplicatedLinear
from cvllm.layers.moe import FusedMoE, select_experts
from cvllm.models.blocks import GatedMLP
from cvllm.quantization.base import QuantizationConfig

# hidden_act -> FusedMoE activation
_MOE_ACT = {"silu": "silu", "swish": "silu", "gelu": "gelu"}


def moe_activation(hidden_act: str) -> str:
    """``FusedMoE``'s name for a config's ``hidden_act``; ValueError if it has none."""
    if hidden_act not in _MOE_ACT:
        raise ValueError(f"unsupported MoE hidden_act {hidden_act!r}; supported: "
                         f"{sorted(_MOE_ACT)}")
    return _MOE_ACT[hidden_act]


def is_sparse_layer(config: ModelConfig, layer_idx: int, num_experts: int) -> bool:
    """transformers' rule for the Qwen MoE families: experts unless listed in
    ``mlp_only_layers`` or off the ``decoder_sparse_step`` stride."""
    step = int(config.get("decoder_sparse_step", 1) or 1)
    return (layer_idx not in (config.get("mlp_only_layers") or [])
            and num_experts > 0 and (layer_idx + 1) % step == 0)


class SparseMoeBlock(nn.Module):
    """Router + routed experts (+ the sigmoid-gated shared expert when its size > 0).
    ``round_weights``: the routing weights are rounded to the activations' dtype before
    the experts weigh them (Qwen3-Next, as transformers does there)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype,
                 quant_config: Optional[QuantizationConfig], prefix: str, *, num_experts: int,
                 renormalize: bool, activation: str, round_weights: bool = False):
        super().__init__()
        hidden, act = config.get("hidden_size"), config.get("hidden_act", "silu")
        self.num_experts, self.top_k = num_experts, int(config.get("num_experts_per_tok"))
        self.renormalize, self.round_weights = renormalize, round_weights
        # The router stays unquantized (as in vLLM): its logits decide the routing.
        self.gate = ReplicatedLinear(hidden, num_experts, bias=False, params_dtype=dtype,
                                     prefix=f"{prefix}.gate")
        self.experts = FusedMoE(num_experts, self.top_k, hidden,
                                int(config.get("moe_intermediate_size")), dtype,
                                prefix=f"{prefix}.experts", activation=activation,
                                quant_config=quant_config)
        shared = int(config.get("shared_expert_intermediate_size", 0) or 0)
        self.shared_expert: Optional[GatedMLP] = None
        self.shared_expert_gate: Optional[ReplicatedLinear] = None
        if shared > 0:
            self.shared_expert = GatedMLP(hidden, shared, act, dtype, quant_config,
                                          f"{prefix}.shared_expert")
            self.shared_expert_gate = ReplicatedLinear(hidden, 1, bias=False, params_dtype=dtype,
                                                       prefix=f"{prefix}.shared_expert_gate")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        router_logits = self.gate(x)  # [T, E]
        topk_weights, topk_ids = select_experts(router_logits, self.top_k, self.renormalize)
        if self.round_weights:
            topk_weights = topk_weights.to(x.dtype)
        out = self.experts(x, topk_weights, topk_ids)  # [T, hidden]
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

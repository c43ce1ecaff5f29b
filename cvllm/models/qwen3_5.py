"""Qwen3.5 text models: ``Qwen3_5ForCausalLM`` (dense MLPs) and ``Qwen3_5MoeForCausalLM``
(every layer MoE, router always renormalised).

The Qwen3-Next decoder (``qwen3_next.py``) with Qwen3.5's linear-attention projections:
``in_proj_qkv`` (all q, then k, then v channels: already the conv's channel order),
``in_proj_z``, and separate ``in_proj_b`` / ``in_proj_a`` (fused here into ``in_proj_ba``).
Built and used exactly like ``Qwen3NextForCausalLM``; the vision tower of the multimodal
checkpoints is not served (its tensors are ignored when present).
"""

from __future__ import annotations

from typing import Optional

import torch

from cvllm.attention.metadata import AttentionMetadata
from cvllm.config import ModelConfig
from cvllm.layers.gated_deltanet import LinearAttnState
from cvllm.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear
from cvllm.models.qwen3_next import (ConfiguredGatedDeltaNet, Qwen3NextForCausalLM,
                                     linear_attn_dims)


class Qwen3_5GatedDeltaNet(ConfiguredGatedDeltaNet):
    def __init__(self, config: ModelConfig, dtype, quant_config, prefix: str):
        super().__init__(config, dtype)
        hk, hv, dk, dv = linear_attn_dims(config)
        hidden = config.get("hidden_size")
        common = dict(bias=False, params_dtype=dtype, quant_config=quant_config)
        # Split as q | k | v so that each rank gets its heads of each.
        self.in_proj_qkv = MergedColumnParallelLinear(
            hidden, [hk * dk, hk * dk, hv * dv], prefix=f"{prefix}.in_proj_qkv", **common)
        self.in_proj_z = ColumnParallelLinear(hidden, hv * dv, prefix=f"{prefix}.in_proj_z",
                                              **common)
        self.in_proj_ba = MergedColumnParallelLinear(hidden, [hv, hv],
                                                     prefix=f"{prefix}.in_proj_ba", **common)
        self.out_proj = RowParallelLinear(hv * dv, hidden, prefix=f"{prefix}.out_proj", **common)

    def forward(self, positions: Optional[torch.Tensor], hidden_states: torch.Tensor,
                state: LinearAttnState, attn_metadata: AttentionMetadata) -> torch.Tensor:
        """A decoder layer's mixer (``positions`` unused: no rope here)."""
        mixed_qkv = self.in_proj_qkv(hidden_states)  # [T, 2*Hk*Dk + Hv*Dv]
        z = self.in_proj_z(hidden_states)  # [T, Hv*Dv]
        b, a = self.in_proj_ba(hidden_states).chunk(2, dim=-1)  # [T, Hv] each
        out = self.forward_core(mixed_qkv, z, b, a, state, attn_metadata)  # [T, Hv*Dv]
        return self.out_proj(out)


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    linear_attn_cls = Qwen3_5GatedDeltaNet
    stacked_params_mapping = Qwen3NextForCausalLM.stacked_params_mapping + [
        (".in_proj_ba", ".in_proj_b", 0),
        (".in_proj_ba", ".in_proj_a", 1),
    ]

    @staticmethod
    def is_moe_layer(config: ModelConfig, i: int) -> bool:
        return False


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    @staticmethod
    def is_moe_layer(config: ModelConfig, i: int) -> bool:
        return True

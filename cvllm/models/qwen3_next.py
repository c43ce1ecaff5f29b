"""Qwen3-Next (``Qwen3NextForCausalLM``): a hybrid decoder of gated DeltaNet
linear-attention layers and gated full-attention layers, with MoE MLPs.

Built by the worker on every rank like every model class. Which layers are linear
attention comes from the config's ``layer_types`` (or ``full_attention_interval``); each
layer's cache is described by ``cache_specs()``: a ``StateSpec`` (conv state + recurrent
state per sequence slot) for a linear-attention layer, a ``FullAttentionSpec`` (paged
K/V) for a full-attention one. ``forward`` gets the worker's ``kv_caches`` list with, per
layer, either ``(k_cache, v_cache)`` or ``(conv_states, ssm_states)``, and the step's
``AttentionMetadata`` (with ``state_slots`` / ``has_initial_state`` for the state layers).

Family traits, all read from the config and declared on the shared blocks
(``models/blocks.py``): zero-centred RMSNorms (``x * (1 + w)``); full attention whose q
projection also yields a per-head output gate (``o *= sigmoid(gate)``), q/k RMSNorm per
head and partial rotary (``partial_rotary_factor``); a linear-attention layer's mixer is
its ``linear_attn`` (the layer's ``attention``); MoE layers per ``decoder_sparse_step`` /
``mlp_only_layers`` with routed experts (softmax top-k, ``norm_topk_prob``, weights
rounded to the activations' dtype) plus a sigmoid-gated shared expert
(``sparse_moe.py``). The Qwen3.5 text models
(``qwen3_5.py``) reuse these classes with their own linear-attention projections.
"""

from __future__ import annotations

from typing import Iterable, Iterator, List, Optional, Tuple

import torch
from torch import nn

from cvllm.attention.metadata import AttentionMetadata
from cvllm.attention.specs import FullAttentionSpec, LayerCacheSpec
from cvllm.config import ModelConfig
from cvllm.layers.gated_deltanet import GatedDeltaNet, LinearAttnState
from cvllm.layers.layernorm import GemmaRMSNorm
from cvllm.layers.linear import ColumnParallelLinear, RowParallelLinear
from cvllm.models.base import DecoderForCausalLM, LayerPlan
from cvllm.models.blocks import LLAMA_LAYER, GatedMLP, GQAOptions, LayerNames
from cvllm.models.llama import QKV_GATE_UP_MAPPING
from cvllm.models.sparse_moe import SparseMoeBlock, is_sparse_layer
from cvllm.quantization.base import QuantizationConfig

LINEAR = "linear_attention"

# Zero-centred RMSNorm (``norm(x) * (1 + w)`` in float32): the same math as Gemma's.
Qwen3NextRMSNorm = GemmaRMSNorm


def layer_types(config: ModelConfig) -> List[str]:
    """``linear_attention`` / ``full_attention`` per layer: the config's ``layer_types``, or
    every ``full_attention_interval``-th layer full (transformers' rule)."""
    types = config.get("layer_types")
    if types:
        if len(types) != config.num_layers:
            raise ValueError(f"layer_types has {len(types)} entries for {config.num_layers} layers")
        return list(types)
    interval = int(config.get("full_attention_interval", 4))
    return ["full_attention" if (i + 1) % interval == 0 else LINEAR
            for i in range(config.num_layers)]


def linear_attn_dims(config: ModelConfig) -> Tuple[int, int, int, int]:
    """``(key heads, value heads, key head dim, value head dim)`` of the linear attention."""
    return (int(config.get("linear_num_key_heads")), int(config.get("linear_num_value_heads")),
            int(config.get("linear_key_head_dim")), int(config.get("linear_value_head_dim")))


class ConfiguredGatedDeltaNet(GatedDeltaNet):
    """``GatedDeltaNet`` sized from a Qwen3-Next / Qwen3.5 config; subclasses add the
    family's projections."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype):
        super().__init__(*linear_attn_dims(config), int(config.get("linear_conv_kernel_dim")),
                         float(config.get("rms_norm_eps", 1e-6)),
                         config.get("hidden_act", "silu"), dtype)


class Qwen3NextGatedDeltaNet(ConfiguredGatedDeltaNet):
    """Qwen3-Next's projections: ``in_proj_qkvz`` and ``in_proj_ba`` are grouped per key
    head (``[Hk, (q, k, v-group, z-group)]``, ``[Hk, (b-group, a-group)]``), so a plain
    column split over ranks hands each rank whole key-head groups."""

    def __init__(self, config: ModelConfig, dtype, quant_config, prefix: str):
        super().__init__(config, dtype)
        hk, hv, dk, dv = linear_attn_dims(config)
        hidden = config.get("hidden_size")
        self.in_proj_qkvz = ColumnParallelLinear(
            hidden, 2 * hk * dk + 2 * hv * dv, bias=False, params_dtype=dtype,
            quant_config=quant_config, prefix=f"{prefix}.in_proj_qkvz")
        self.in_proj_ba = ColumnParallelLinear(
            hidden, 2 * hv, bias=False, params_dtype=dtype, quant_config=quant_config,
            prefix=f"{prefix}.in_proj_ba")
        self.out_proj = RowParallelLinear(hv * dv, hidden, bias=False, params_dtype=dtype,
                                          quant_config=quant_config, prefix=f"{prefix}.out_proj")

    def forward(self, positions: Optional[torch.Tensor], hidden_states: torch.Tensor,
                state: LinearAttnState, attn_metadata: AttentionMetadata) -> torch.Tensor:
        """A decoder layer's mixer (``positions`` unused: no rope here)."""
        T, hk, dk = hidden_states.shape[0], self.num_k_heads, self.head_k_dim
        group_v = self.value_dim // hk  # one key head's value channels
        qkvz = self.in_proj_qkvz(hidden_states).view(T, hk, -1)  # [T, Hk, 2Dk + 2(Hv/Hk)Dv]
        q, k, v, z = qkvz.split([dk, dk, group_v, group_v], dim=-1)
        ba = self.in_proj_ba(hidden_states).view(T, hk, -1)  # [T, Hk, 2 Hv/Hk]
        b, a = ba.chunk(2, dim=-1)
        mixed_qkv = torch.cat([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], dim=-1)
        out = self.forward_core(mixed_qkv, z.reshape(T, -1), b.reshape(T, -1), a.reshape(T, -1),
                                state, attn_metadata)  # [T, Hv*Dv]
        return self.out_proj(out)


class Qwen3NextForCausalLM(DecoderForCausalLM):
    linear_attn_cls = Qwen3NextGatedDeltaNet
    has_experts = True
    norm_cls = Qwen3NextRMSNorm
    stacked_params_mapping = QKV_GATE_UP_MAPPING
    # Multi-token-prediction heads and vision towers some checkpoints carry.
    ignored_weight_prefixes = ("mtp.", "model.visual.")
    ignored_weight_substrings = ("rotary_emb.inv_freq",)

    @staticmethod
    def is_moe_layer(config: ModelConfig, i: int) -> bool:
        """transformers' rule (``sparse_moe.is_sparse_layer``) over ``num_experts``."""
        return is_sparse_layer(config, i, int(config.get("num_experts", 0) or 0))

    def layer_plans(self, config: ModelConfig) -> List[LayerPlan]:
        # Qwen3.5's text rope is multimodal (mrope) in name only: with one position per
        # token on all three axes it is plain rope over the partial rotary dims.
        rope = self.rotary_embedding(config)
        return [LayerPlan(rope, kind=kind) for kind in layer_types(config)]

    def names_of(self, config: ModelConfig, plan: LayerPlan) -> LayerNames:
        if plan.kind == LINEAR:
            return (("attention", "linear_attn"),) + LLAMA_LAYER[1:]
        return LLAMA_LAYER

    def attention_options(self, config: ModelConfig, dtype: torch.dtype) -> GQAOptions:
        # q_proj rows per head: D query then D gate, so TP keeps each head with its gate.
        return GQAOptions(output_gate=True,
                          qk_norm=lambda head_dim, heads: self.make_norm(config, dtype, head_dim))

    def make_attention(self, config: ModelConfig, plan: LayerPlan, options: GQAOptions,
                       dtype: torch.dtype, quant_config: Optional[QuantizationConfig],
                       prefix: str) -> nn.Module:
        if plan.kind == LINEAR:
            return self.linear_attn_cls(config, dtype, quant_config, prefix)
        if plan.kind != "full_attention":
            raise ValueError(f"unsupported layer type {plan.kind!r}")
        return super().make_attention(config, plan, options, dtype, quant_config, prefix)

    def make_mlp(self, config: ModelConfig, layer_idx: int, dtype: torch.dtype,
                 quant_config: Optional[QuantizationConfig], prefix: str) -> nn.Module:
        if self.is_moe_layer(config, layer_idx):
            # Qwen3.5-MoE configs drop norm_topk_prob: their router always renormalises.
            return SparseMoeBlock(config, dtype, quant_config, prefix,
                                  num_experts=int(config.get("num_experts")),
                                  renormalize=bool(config.get("norm_topk_prob", True)),
                                  activation=config.get("hidden_act", "silu"),
                                  round_weights=True)
        return GatedMLP(config.get("hidden_size"), int(config.get("intermediate_size")),
                        config.get("hidden_act", "silu"), dtype, quant_config, prefix)

    def cache_specs(self) -> List[LayerCacheSpec]:
        """Per layer: the linear-attention state slots, or the paged K/V of full attention."""
        specs: List[LayerCacheSpec] = []
        for layer, kind in zip(self.model.layers, layer_types(self.config)):
            attn = layer.attention
            if kind == LINEAR:
                specs.append(attn.state_spec(self.dtype))
            else:
                specs.append(FullAttentionSpec(attn.num_kv_heads, attn.head_dim, self.dtype))
        return specs

    def checkpoint_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> Iterator:
        return ((n, t) for n, t in weights if not n.startswith(self.ignored_weight_prefixes))

"""Qwen3-Next (``Qwen3NextForCausalLM``): a hybrid decoder of gated DeltaNet
linear-attention layers and gated full-attention layers, with MoE MLPs.

Built by the worker on every rank like every model class. Which layers are linear
attention comes from the config's ``layer_types`` (or ``full_attention_interval``); each
layer's cache is described by ``cache_specs()``: a ``StateSpec`` (conv state + recurrent
state per sequence slot) for a linear-attention layer, a ``FullAttentionSpec`` (paged
K/V) for a full-attention one. ``forward`` gets the worker's ``kv_caches`` list with, per
layer, either ``(k_cache, v_cache)`` or ``(conv_states, ssm_states)``, and the step's
``AttentionMetadata`` (with ``state_slots`` / ``has_initial_state`` for the state layers).

Family traits, all read from the config: zero-centred RMSNorms (``x * (1 + w)``); full
attention whose q projection also yields a per-head output gate (``o *= sigmoid(gate)``),
q/k RMSNorm per head and partial rotary (``partial_rotary_factor``); MoE layers per
``decoder_sparse_step`` / ``mlp_only_layers`` with routed experts (softmax top-k,
``norm_topk_prob``) plus a sigmoid-gated shared expert. The Qwen3.5 text models
(``qwen3_5.py``) reuse these classes with their own linear-attention projections.
"""

from __future__ import annotations

from typing import Iterable, Iterator, List, Optional, Sequence, Set, Tuple

import torch
from torch import nn

from cvllm.attention.metadata import AttentionMetadata
from cvllm.attention.specs import FullAttentionSpec, LayerCacheSpec
from cvllm.config import ModelConfig
from cvllm.layers.activation import get_act_and_mul_fn
from cvllm.layers.attention import Attention
from cvllm.layers.embedding import LogitsProcessor, ParallelLMHead, VocabParallelEmbedding
from cvllm.layers.gated_deltanet import GatedDeltaNet, LinearAttnState
from cvllm.layers.layernorm import GemmaRMSNorm
from cvllm.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from cvllm.layers.moe import FusedMoE, select_experts
from cvllm.layers.rotary import RotaryEmbedding, get_rope, rope_parameters_from_config
from cvllm.layers.utils import torch_dtype
from cvllm.models import utils as model_utils
from cvllm.models.moe_utils import load_moe_model_weights
from cvllm.quantization.base import QuantizationConfig
from cvllm.models.base import CausalLMBase


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
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(config.num_layers)]


class Qwen3NextMLP(nn.Module):
    def __init__(self, config: ModelConfig, intermediate_size: int, dtype, quant_config,
                 prefix: str, reduce_results: bool = True):
        super().__init__()
        hidden = config.get("hidden_size")
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden, [intermediate_size] * 2, bias=False, params_dtype=dtype,
            quant_config=quant_config, prefix=f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(
            intermediate_size, hidden, bias=False, reduce_results=reduce_results,
            params_dtype=dtype, quant_config=quant_config, prefix=f"{prefix}.down_proj")
        self.act_fn = get_act_and_mul_fn(config.get("hidden_act", "silu"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj(x), act_fn=self.act_fn)  # [T, hidden]


class Qwen3NextSparseMoeBlock(nn.Module):
    """Routed experts (softmax top-k) plus a shared expert scaled by ``sigmoid(gate(x))``."""

    def __init__(self, config: ModelConfig, dtype, quant_config, prefix: str):
        super().__init__()
        hidden = config.get("hidden_size")
        self.num_experts = int(config.get("num_experts"))
        self.top_k = int(config.get("num_experts_per_tok"))
        # Qwen3.5-MoE configs drop the key: their router always renormalises.
        self.renormalize = bool(config.get("norm_topk_prob", True))
        self.gate = ReplicatedLinear(hidden, self.num_experts, bias=False, params_dtype=dtype,
                                     prefix=f"{prefix}.gate")
        self.experts = FusedMoE(self.num_experts, self.top_k, hidden,
                                int(config.get("moe_intermediate_size")), dtype,
                                prefix=f"{prefix}.experts",
                                activation=config.get("hidden_act", "silu"),
                                quant_config=quant_config)
        shared = int(config.get("shared_expert_intermediate_size") or 0)
        self.shared_expert = (Qwen3NextMLP(config, shared, dtype, quant_config,
                                           f"{prefix}.shared_expert") if shared else None)
        self.shared_expert_gate = (ReplicatedLinear(hidden, 1, bias=False, params_dtype=dtype,
                                                    prefix=f"{prefix}.shared_expert_gate")
                                   if shared else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        router_logits = self.gate(x)  # [T, E]
        topk_weights, topk_ids = select_experts(router_logits, self.top_k, self.renormalize)
        # transformers rounds the routing weights to the activations' dtype
        out = self.experts(x, topk_weights.to(x.dtype), topk_ids)  # [T, hidden]
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


class Qwen3NextAttention(nn.Module):
    """Full attention with a per-head output gate from the q projection (``q_proj`` rows
    per head: D query then D gate), per-head q/k norms and partial rotary."""

    def __init__(self, config: ModelConfig, rotary_emb: RotaryEmbedding, dtype, quant_config,
                 prefix: str):
        super().__init__()
        hidden, eps = config.get("hidden_size"), float(config.get("rms_norm_eps", 1e-6))
        self.head_dim = config.head_dim
        bias = bool(config.get("attention_bias", False))
        # q_proj rows per head: D query then D gate, so TP keeps each head with its gate.
        self.qkv_proj = QKVParallelLinear(hidden, self.head_dim, config.num_heads,
                                          config.num_kv_heads, bias=bias, params_dtype=dtype,
                                          quant_config=quant_config, prefix=f"{prefix}.qkv_proj",
                                          q_rows_per_head=2)
        # This rank's heads: the parallel layer owns the split (and any KV replication).
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(config.num_heads * self.head_dim, hidden, bias=bias,
                                        params_dtype=dtype, quant_config=quant_config,
                                        prefix=f"{prefix}.o_proj")
        self.q_norm = Qwen3NextRMSNorm(self.head_dim, eps, dtype)
        self.k_norm = Qwen3NextRMSNorm(self.head_dim, eps, dtype)
        self.rotary_emb = rotary_emb
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim**-0.5,
                              self.num_kv_heads, prefix=f"{prefix}.attn",
                              backend=config.attention_backend)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, kv_cache,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        T, D = hidden_states.shape[0], self.head_dim
        qg, k, v = self.qkv_proj(hidden_states).split(
            [2 * self.num_heads * D, self.num_kv_heads * D, self.num_kv_heads * D], dim=-1)
        q, gate = qg.view(T, self.num_heads, 2 * D).chunk(2, dim=-1)  # [T, H, D] each
        q = self.q_norm(q.contiguous())  # [T, H, D]
        k = self.k_norm(k.reshape(T, self.num_kv_heads, D))  # [T, Hkv, D]
        out = self.attn(q.reshape(T, -1), k.reshape(T, -1), v, kv_cache, attn_metadata,
                        positions, self.rotary_emb)  # [T, H*D]; q, k rotated with the K/V write
        out = out * torch.sigmoid(gate.reshape(T, -1))
        return self.o_proj(out)  # [T, hidden]


class Qwen3NextGatedDeltaNet(GatedDeltaNet):
    """Qwen3-Next's projections: ``in_proj_qkvz`` and ``in_proj_ba`` are grouped per key
    head (``[Hk, (q, k, v-group, z-group)]``, ``[Hk, (b-group, a-group)]``), so a plain
    column split over ranks hands each rank whole key-head groups."""

    def __init__(self, config: ModelConfig, dtype, quant_config, prefix: str):
        hk, hv = int(config.get("linear_num_key_heads")), int(config.get("linear_num_value_heads"))
        dk, dv = int(config.get("linear_key_head_dim")), int(config.get("linear_value_head_dim"))
        super().__init__(hk, hv, dk, dv, int(config.get("linear_conv_kernel_dim")),
                         float(config.get("rms_norm_eps", 1e-6)),
                         config.get("hidden_act", "silu"), dtype)
        hidden = config.get("hidden_size")
        self.in_proj_qkvz = ColumnParallelLinear(
            hidden, 2 * hk * dk + 2 * hv * dv, bias=False, params_dtype=dtype,
            quant_config=quant_config, prefix=f"{prefix}.in_proj_qkvz")
        self.in_proj_ba = ColumnParallelLinear(
            hidden, 2 * hv, bias=False, params_dtype=dtype, quant_config=quant_config,
            prefix=f"{prefix}.in_proj_ba")
        self.out_proj = RowParallelLinear(hv * dv, hidden, bias=False, params_dtype=dtype,
                                          quant_config=quant_config, prefix=f"{prefix}.out_proj")

    def forward(self, hidden_states: torch.Tensor, state: LinearAttnState,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
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


class Qwen3NextDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_type: str, is_moe: bool, linear_cls,
                 rotary_emb: RotaryEmbedding, dtype, quant_config, prefix: str):
        super().__init__()
        hidden, eps = config.get("hidden_size"), float(config.get("rms_norm_eps", 1e-6))
        self.layer_type = layer_type
        if layer_type == "linear_attention":
            self.linear_attn = linear_cls(config, dtype, quant_config, f"{prefix}.linear_attn")
        elif layer_type == "full_attention":
            self.self_attn = Qwen3NextAttention(config, rotary_emb, dtype, quant_config,
                                                f"{prefix}.self_attn")
        else:
            raise ValueError(f"unsupported layer type {layer_type!r}")
        self.mlp = (Qwen3NextSparseMoeBlock(config, dtype, quant_config, f"{prefix}.mlp") if is_moe
                    else Qwen3NextMLP(config, int(config.get("intermediate_size")), dtype,
                                      quant_config, f"{prefix}.mlp"))
        self.input_layernorm = Qwen3NextRMSNorm(hidden, eps, dtype)
        self.post_attention_layernorm = Qwen3NextRMSNorm(hidden, eps, dtype)

    def forward(self, positions, hidden_states, residual, kv_cache, attn_metadata):
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        if self.layer_type == "linear_attention":
            hidden_states = self.linear_attn(hidden_states, kv_cache, attn_metadata)
        else:
            hidden_states = self.self_attn(positions, hidden_states, kv_cache, attn_metadata)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class Qwen3NextModel(nn.Module):
    def __init__(self, config: ModelConfig, linear_cls, moe_layers: Sequence[bool], dtype,
                 quant_config, prefix: str = "model"):
        super().__init__()
        hidden = config.get("hidden_size")
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, hidden, dtype,
                                                   prefix=f"{prefix}.embed_tokens",
            quant_config=quant_config)
        # Qwen3.5's text rope is multimodal (mrope) in name only: with one position per
        # token on all three axes it is plain rope over the partial rotary dims.
        rotary_emb = get_rope(config.head_dim, config.max_model_len,
                              rope_parameters_from_config(config.hf_config),
                              config.native_max_len, is_neox_style=True)
        self.layers = nn.ModuleList(
            Qwen3NextDecoderLayer(config, kind, moe_layers[i], linear_cls, rotary_emb, dtype,
                                  quant_config, f"{prefix}.layers.{i}")
            for i, kind in enumerate(layer_types(config))
        )
        self.norm = Qwen3NextRMSNorm(hidden, float(config.get("rms_norm_eps", 1e-6)), dtype)

    def forward(self, input_ids, positions, attn_metadata, kv_caches) -> torch.Tensor:
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"got {len(kv_caches)} caches for {len(self.layers)} layers")
        hidden_states = self.embed_tokens(input_ids)  # [T, hidden]
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden_states, residual = layer(positions, hidden_states, residual, kv_cache,
                                            attn_metadata)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class Qwen3NextForCausalLM(CausalLMBase):
    linear_attn_cls = Qwen3NextGatedDeltaNet
    stacked_params_mapping = [
        (".qkv_proj", ".q_proj", "q"),
        (".qkv_proj", ".k_proj", "k"),
        (".qkv_proj", ".v_proj", "v"),
        (".gate_up_proj", ".gate_proj", 0),
        (".gate_up_proj", ".up_proj", 1),
    ]
    # Multi-token-prediction heads and vision towers some checkpoints carry.
    ignored_weight_prefixes = ("mtp.", "model.visual.")
    ignored_weight_substrings = ("rotary_emb.inv_freq",)

    def __init__(self, model_config: ModelConfig,
                 quant_config: Optional[QuantizationConfig] = None):
        super().__init__()
        self.config = model_config
        self.dtype = torch_dtype(model_config.dtype)
        moe_layers = [self.is_moe_layer(model_config, i) for i in range(model_config.num_layers)]
        self.model = Qwen3NextModel(model_config, self.linear_attn_cls, moe_layers, self.dtype,
                                    quant_config)
        hidden = model_config.get("hidden_size")
        self.tie_word_embeddings = bool(model_config.get("tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(model_config.vocab_size, hidden, params_dtype=self.dtype,
                                      prefix="lm_head", quant_config=quant_config)
        if self.tie_word_embeddings:
            self.lm_head.tie_weights(self.model.embed_tokens)
        self.logits_processor = LogitsProcessor(model_config.vocab_size)

    @staticmethod
    def is_moe_layer(config: ModelConfig, i: int) -> bool:
        """transformers' rule: sparse unless listed in ``mlp_only_layers``, every
        ``decoder_sparse_step``-th layer, when the model has experts."""
        step = int(config.get("decoder_sparse_step", 1) or 1)
        return (i not in (config.get("mlp_only_layers") or [])
                and int(config.get("num_experts", 0) or 0) > 0 and (i + 1) % step == 0)

    def cache_specs(self) -> List[LayerCacheSpec]:
        """Per layer: the linear-attention state slots, or the paged K/V of full attention."""
        specs: List[LayerCacheSpec] = []
        for layer in self.model.layers:
            if layer.layer_type == "linear_attention":
                specs.append(layer.linear_attn.state_spec(self.dtype))
            else:
                attn = layer.self_attn
                specs.append(FullAttentionSpec(attn.num_kv_heads, attn.head_dim, self.dtype))
        return specs

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> Set[str]:
        """HF-named tensors (experts per expert or stacked); raises ``WeightLoadError``
        listing unknown or missing ones."""
        skip = ("lm_head.weight",) if self.tie_word_embeddings else ()
        return load_moe_model_weights(self, self._drop_ignored(weights),
                                      self.stacked_params_mapping,
                                      self.ignored_weight_substrings, skip)

    def _drop_ignored(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> Iterator:
        return ((n, t) for n, t in weights if not n.startswith(self.ignored_weight_prefixes))

    def init_dummy_weights(self, seed: int) -> None:
        model_utils.init_dummy_weights(self, seed)

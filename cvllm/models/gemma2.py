"""Gemma 2 decoder (Gemma2ForCausalLM); ``gemma3.py`` builds Gemma 3 on these classes.

Built by the worker on every rank (``get_model_class(arch)(model_config)``), holding this
rank's weight shards; it owns no KV cache: ``forward`` takes the worker's per-layer
``kv_caches`` each step. What sets the family apart from Llama, each read from the config
(DESIGN rule 10), with transformers' own defaults for keys a config.json leaves out:

- embeddings multiplied by sqrt(hidden_size), that factor first rounded to the model dtype
  (HF keeps it as a tensor of the weights' dtype);
- four Gemma RMSNorms per layer (scale ``1 + weight``): input, post-attention,
  pre-feedforward, post-feedforward; each sub-block's output is normed before its
  residual add;
- a gated MLP with ``hidden_activation`` (GELU-tanh);
- attention scaled by ``query_pre_attn_scalar ** -0.5`` rather than head_dim's;
- ``attn_logit_softcapping`` on attention scores and ``final_logit_softcapping`` on the
  logits, both ``tanh(x / cap) * cap``;
- sliding-window and global layers (``layer_types``, else every
  ``sliding_window_pattern``-th layer global). HF's window: a query sees the
  ``sliding_window`` latest positions, its own included, as the attention backends do.
  ``cache_specs()`` tells the worker which layers need only their window's blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch
from torch import nn

from cvllm.attention.kv_cache import KVCache
from cvllm.attention.metadata import AttentionMetadata
from cvllm.attention.specs import FullAttentionSpec, LayerCacheSpec, SlidingWindowSpec
from cvllm.config import ModelConfig
from cvllm.layers.activation import get_act_and_mul_fn
from cvllm.layers.attention import Attention
from cvllm.layers.embedding import LogitsProcessor, ParallelLMHead, VocabParallelEmbedding
from cvllm.layers.layernorm import GemmaRMSNorm
from cvllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from cvllm.layers.rotary import RotaryEmbedding, get_rope, rope_parameters_from_config
from cvllm.layers.utils import torch_dtype
from cvllm.models.base import CausalLMBase
from cvllm.quantization.base import QuantizationConfig

SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass(frozen=True)
class GemmaLayerPlan:
    """What may differ from one Gemma decoder layer to the next; built by the model class
    from the config, read by the layer's constructor."""

    rotary_emb: RotaryEmbedding
    sliding_window: Optional[int]
    """Window of a sliding layer; None for a global (full attention) layer."""
    attn_softcap: Optional[float]
    qk_norm: bool
    """Gemma 3: a Gemma RMSNorm over each q and k head before rope."""


def gemma_layer_types(config: ModelConfig, default_pattern: int) -> List[str]:
    """Each layer's HF type, ``sliding_attention`` or ``full_attention``: the config's
    ``layer_types``, or else (older configs) every ``sliding_window_pattern``-th layer
    global, as transformers derives them."""
    n = config.num_layers
    types = config.get("layer_types")
    if types is not None:
        if len(types) != n or any(t not in (SLIDING, FULL) for t in types):
            raise ValueError(f"layer_types must list {n} of {SLIDING!r} / {FULL!r}, got {types!r}")
        return list(types)
    pattern = int(config.get("sliding_window_pattern") or default_pattern)
    return [SLIDING if (i + 1) % pattern else FULL for i in range(n)]


class GemmaMLP(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        quant_config: Optional[QuantizationConfig],
        prefix: str,
    ):
        super().__init__()
        hidden, inter = config.get("hidden_size"), config.get("intermediate_size")
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden, [inter, inter], bias=False, params_dtype=dtype,
            quant_config=quant_config, prefix=f"{prefix}.gate_up_proj",
        )
        self.down_proj = RowParallelLinear(
            inter, hidden, bias=False, params_dtype=dtype,
            quant_config=quant_config, prefix=f"{prefix}.down_proj",
        )
        # Gemma configs name it hidden_activation; some older ones only hidden_act.
        act = config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh"
        self.act_fn = get_act_and_mul_fn(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj(x), act_fn=self.act_fn)  # [T, hidden]


class GemmaAttention(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        plan: GemmaLayerPlan,
        dtype: torch.dtype,
        quant_config: Optional[QuantizationConfig],
        prefix: str,
    ):
        super().__init__()
        hidden = config.get("hidden_size")
        self.head_dim = config.head_dim
        bias = bool(config.get("attention_bias", False))
        self.qkv_proj = QKVParallelLinear(
            hidden, self.head_dim, config.num_heads, config.num_kv_heads, bias=bias,
            params_dtype=dtype, quant_config=quant_config, prefix=f"{prefix}.qkv_proj",
        )
        # This rank's heads: the parallel layer owns the split (and any KV replication).
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(
            config.num_heads * self.head_dim, hidden, bias=bias, params_dtype=dtype,
            quant_config=quant_config, prefix=f"{prefix}.o_proj",
            input_blocks=self.qkv_proj.o_proj_input_blocks, block_size=self.head_dim,
        )
        if plan.qk_norm:
            eps = float(config.get("rms_norm_eps", 1e-6))
            self.q_norm = GemmaRMSNorm(self.head_dim, eps, dtype)
            self.k_norm = GemmaRMSNorm(self.head_dim, eps, dtype)
        self.qk_norm = plan.qk_norm
        self.rotary_emb = plan.rotary_emb
        # transformers' default for both Gemma 2 and 3 when the config leaves it out.
        scalar = float(config.get("query_pre_attn_scalar", 256))
        self.attn = Attention(
            self.num_heads, self.head_dim, scalar**-0.5, self.num_kv_heads,
            sliding_window=plan.sliding_window, logits_soft_cap=plan.attn_softcap,
            prefix=f"{prefix}.attn",
            backend=config.attention_backend,
        )

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        kv_cache: KVCache,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)  # [T, (H + 2*Hkv) * D]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm:
            T = q.shape[0]
            q = self.q_norm(q.reshape(T, self.num_heads, self.head_dim))  # [T, H, D]
            k = self.k_norm(k.reshape(T, self.num_kv_heads, self.head_dim))  # [T, Hkv, D]
            q, k = q.reshape(T, self.q_size), k.reshape(T, self.kv_size)
        # The backend rotates q and k (in place) together with its K/V cache write.
        out = self.attn(q, k, v, kv_cache, attn_metadata, positions, self.rotary_emb)  # [T, H*D]
        return self.o_proj(out)  # [T, hidden]


class GemmaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        plan: GemmaLayerPlan,
        dtype: torch.dtype,
        quant_config: Optional[QuantizationConfig],
        prefix: str,
    ):
        super().__init__()
        hidden, eps = config.get("hidden_size"), float(config.get("rms_norm_eps", 1e-6))
        self.self_attn = GemmaAttention(config, plan, dtype, quant_config, f"{prefix}.self_attn")
        self.mlp = GemmaMLP(config, dtype, quant_config, f"{prefix}.mlp")
        self.input_layernorm = GemmaRMSNorm(hidden, eps, dtype)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps, dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps, dtype)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps, dtype)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: Optional[torch.Tensor],
        kv_cache: KVCache,
        attn_metadata: AttentionMetadata,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(mlp block output, residual stream)``; the next layer's input norm
        adds them (the residual add fused into the norm, as in llama.py)."""
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, kv_cache, attn_metadata)
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states, residual = self.pre_feedforward_layernorm(hidden_states, residual)
        hidden_states = self.mlp(hidden_states)
        return self.post_feedforward_layernorm(hidden_states), residual


class GemmaModel(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        plans: Sequence[GemmaLayerPlan],
        dtype: torch.dtype,
        quant_config: Optional[QuantizationConfig],
        prefix: str = "model",
    ):
        super().__init__()
        hidden = config.get("hidden_size")
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, hidden, dtype, prefix=f"{prefix}.embed_tokens",
            quant_config=quant_config
        )
        # HF rounds sqrt(hidden) to the weights' dtype before scaling (bf16: 8 bits).
        self.embed_scale = float(torch.tensor(hidden**0.5, dtype=dtype))
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(config, plan, dtype, quant_config, f"{prefix}.layers.{i}")
            for i, plan in enumerate(plans)
        )
        self.norm = GemmaRMSNorm(hidden, float(config.get("rms_norm_eps", 1e-6)), dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
        kv_caches: Sequence[KVCache],
    ) -> torch.Tensor:
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"got {len(kv_caches)} KV caches for {len(self.layers)} layers")
        hidden_states = self.embed_tokens(input_ids) * self.embed_scale  # [T, hidden]
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden_states, residual = layer(
                positions, hidden_states, residual, kv_cache, attn_metadata
            )
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class Gemma2ForCausalLM(CausalLMBase):
    uneven_tp_heads = True  # tp need not divide the attention heads (the builder asks)
    # transformers' Gemma2Config defaults, for keys a config.json leaves out.
    default_sliding_window_pattern = 2
    default_final_logit_softcapping: Optional[float] = 30.0
    default_attn_logit_softcapping: Optional[float] = 50.0
    default_sliding_window = 4096
    qk_norm = False
    # HF checkpoint parts fused into one parameter here: (param part, checkpoint part, shard_id)
    stacked_params_mapping = [
        (".qkv_proj", ".q_proj", "q"),
        (".qkv_proj", ".k_proj", "k"),
        (".qkv_proj", ".v_proj", "v"),
        (".gate_up_proj", ".gate_proj", 0),
        (".gate_up_proj", ".up_proj", 1),
    ]
    ignored_weight_substrings = ("rotary_emb.inv_freq",)

    def __init__(
        self, model_config: ModelConfig, quant_config: Optional[QuantizationConfig] = None
    ):
        super().__init__()
        if model_config.get("use_bidirectional_attention"):
            raise ValueError(
                f"{model_config.architecture} with use_bidirectional_attention is an "
                "embedding model, not a causal LM; cvllm does not serve it"
            )
        self.config = model_config
        dtype = torch_dtype(model_config.dtype)
        self.model = GemmaModel(model_config, self._layer_plans(model_config), dtype, quant_config)
        hidden = model_config.get("hidden_size")
        self.tie_word_embeddings = bool(model_config.get("tie_word_embeddings", True))
        self.lm_head = ParallelLMHead(
            model_config.vocab_size, hidden, params_dtype=dtype, prefix="lm_head",
            quant_config=quant_config
        )
        if self.tie_word_embeddings:
            self.lm_head.tie_weights(self.model.embed_tokens)
        cap = model_config.get("final_logit_softcapping", self.default_final_logit_softcapping)
        self.logits_processor = LogitsProcessor(
            model_config.vocab_size, soft_cap=float(cap) if cap else None
        )

    def _layer_types(self, config: ModelConfig) -> List[str]:
        return gemma_layer_types(config, self.default_sliding_window_pattern)

    def _rotary_embs(self, config: ModelConfig) -> Tuple[RotaryEmbedding, RotaryEmbedding]:
        """``(global, local)`` rope; Gemma 2 uses one for both."""
        rope = get_rope(
            config.head_dim,
            config.max_model_len,
            rope_parameters_from_config(config.hf_config),
            config.native_max_len,
            is_neox_style=True,
        )
        return rope, rope

    def _attn_softcap(self, config: ModelConfig) -> Optional[float]:
        cap = config.get("attn_logit_softcapping", self.default_attn_logit_softcapping)
        return float(cap) if cap else None

    def _layer_plans(self, config: ModelConfig) -> List[GemmaLayerPlan]:
        global_rope, local_rope = self._rotary_embs(config)
        softcap = self._attn_softcap(config)
        # A null sliding_window makes the "sliding" layers global in attention, though
        # they keep the local rope (HF picks rope by layer type, the mask by window).
        window = config.get("sliding_window", self.default_sliding_window)
        plans = []
        for layer_type in self._layer_types(config):
            sliding = layer_type == SLIDING
            plans.append(GemmaLayerPlan(
                rotary_emb=local_rope if sliding else global_rope,
                sliding_window=int(window) if sliding and window else None,
                attn_softcap=softcap,
                qk_norm=self.qk_norm,
            ))
        return plans

    def cache_specs(self) -> List[LayerCacheSpec]:
        """Per-layer KV cache specs (this rank's KV heads): sliding layers keep only
        their window's blocks."""
        dtype = torch_dtype(self.config.dtype)
        specs: List[LayerCacheSpec] = []
        for layer in self.model.layers:
            attn = layer.self_attn.attn
            if attn.sliding_window:
                specs.append(
                    SlidingWindowSpec(attn.num_kv_heads, attn.head_size, dtype, attn.sliding_window)
                )
            else:
                specs.append(FullAttentionSpec(attn.num_kv_heads, attn.head_size, dtype))
        return specs

"""Phi-2 decoder (PhiForCausalLM).

As in transformers' ``PhiDecoderLayer``: one LayerNorm (with bias) feeds attention and the
MLP in parallel, ``out = attn(ln(x)) + mlp(ln(x)) + x``; q/k/v, ``dense``, ``fc1``/``fc2``
and the LM head all carry biases; rope covers the first ``partial_rotary_factor`` of each
head; the MLP is ungated (``hidden_act``, gelu_new for Phi-2); an optional ``qk_layernorm``
(one LayerNorm over head_dim shared by all heads) precedes rope; the final norm is
``final_layernorm``. The causal-LM wrapper is Llama's (``model_cls`` hook) plus the LM
head bias. Built by the worker on every rank like every model class.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn

from cvllm.attention.kv_cache import KVCache
from cvllm.attention.metadata import AttentionMetadata
from cvllm.config import ModelConfig
from cvllm.layers.activation import get_act_fn
from cvllm.layers.attention import Attention
from cvllm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from cvllm.layers.layernorm import LayerNorm
from cvllm.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from cvllm.layers.rotary import RotaryEmbedding, get_rope, rope_parameters_from_config
from cvllm.models import utils as model_utils
from cvllm.models.llama import LlamaForCausalLM
from cvllm.quantization.base import QuantizationConfig, set_weight_attrs


def reset_layernorms_(model: nn.Module) -> None:
    """Dummy weights: LayerNorms back to identity (the shared init draws them at random)."""
    for module in model.modules():
        if isinstance(module, LayerNorm):
            module.reset_parameters()


class PhiAttention(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        rotary_emb: RotaryEmbedding,
        dtype: torch.dtype,
        quant_config: Optional[QuantizationConfig],
        prefix: str,
    ):
        super().__init__()
        hidden = config.get("hidden_size")
        self.head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(
            hidden, self.head_dim, config.num_heads, config.num_kv_heads, bias=True,
            params_dtype=dtype, quant_config=quant_config, prefix=f"{prefix}.qkv_proj",
        )
        # This rank's heads: the parallel layer owns the split (and any KV replication).
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.dense = RowParallelLinear(
            config.num_heads * self.head_dim, hidden, bias=True, params_dtype=dtype,
            quant_config=quant_config, prefix=f"{prefix}.dense",
            input_blocks=self.qkv_proj.o_proj_input_blocks, block_size=self.head_dim,
        )
        if config.get("qk_layernorm", False):
            eps = float(config.get("layer_norm_eps", 1e-5))
            self.q_layernorm = LayerNorm(self.head_dim, eps, dtype)
            self.k_layernorm = LayerNorm(self.head_dim, eps, dtype)
        else:
            self.q_layernorm = self.k_layernorm = None
        self.rotary_emb = rotary_emb
        self.attn = Attention(
            self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads,
            prefix=f"{prefix}.attn",
            backend=config.attention_backend,
        )

    def _norm_heads(self, x: torch.Tensor, norm: LayerNorm) -> torch.Tensor:
        T = x.shape[0]
        return norm(x.reshape(T, -1, self.head_dim)).reshape(T, -1)  # [T, heads * D]

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        kv_cache: KVCache,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)  # [T, (H + 2*Hkv) * D]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_layernorm is not None:
            q, k = self._norm_heads(q, self.q_layernorm), self._norm_heads(k, self.k_layernorm)
        # The backend rotates q and k (in place) together with its K/V cache write.
        out = self.attn(q, k, v, kv_cache, attn_metadata, positions, self.rotary_emb)  # [T, H*D]
        return self.dense(out)  # [T, hidden]


class PhiMLP(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        quant_config: Optional[QuantizationConfig],
        prefix: str,
    ):
        super().__init__()
        hidden, inter = config.get("hidden_size"), config.get("intermediate_size")
        self.fc1 = ColumnParallelLinear(
            hidden, inter, bias=True, params_dtype=dtype, quant_config=quant_config,
            prefix=f"{prefix}.fc1",
        )
        self.fc2 = RowParallelLinear(
            inter, hidden, bias=True, params_dtype=dtype, quant_config=quant_config,
            prefix=f"{prefix}.fc2",
        )
        self.act = get_act_fn(config.get("hidden_act", "gelu_new"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))  # [T, hidden]


class PhiDecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        rotary_emb: RotaryEmbedding,
        dtype: torch.dtype,
        quant_config: Optional[QuantizationConfig],
        prefix: str,
    ):
        super().__init__()
        eps = float(config.get("layer_norm_eps", 1e-5))
        self.input_layernorm = LayerNorm(config.get("hidden_size"), eps, dtype)
        self.self_attn = PhiAttention(
            config, rotary_emb, dtype, quant_config, f"{prefix}.self_attn"
        )
        self.mlp = PhiMLP(config, dtype, quant_config, f"{prefix}.mlp")

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        kv_cache: KVCache,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        h = self.input_layernorm(hidden_states)  # [T, hidden]
        attn = self.self_attn(positions, h, kv_cache, attn_metadata)
        return attn + self.mlp(h) + hidden_states  # HF's order of the adds


class PhiModel(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        quant_config: Optional[QuantizationConfig],
        sliding_window: None = None,
        prefix: str = "model",
    ):
        """``sliding_window`` is part of Llama's ``model_cls`` signature; Phi-2 has none."""
        super().__init__()
        if sliding_window is not None:
            raise ValueError("Phi-2 has no sliding-window attention")
        hidden = config.get("hidden_size")
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, hidden, dtype, prefix=f"{prefix}.embed_tokens",
            quant_config=quant_config
        )
        rotary_emb = get_rope(
            config.head_dim,
            config.max_model_len,
            rope_parameters_from_config(config.hf_config),
            config.native_max_len,
            is_neox_style=True,
        )
        self.layers = nn.ModuleList(
            PhiDecoderLayer(config, rotary_emb, dtype, quant_config, f"{prefix}.layers.{i}")
            for i in range(config.num_layers)
        )
        self.final_layernorm = LayerNorm(hidden, float(config.get("layer_norm_eps", 1e-5)), dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
        kv_caches: Sequence[KVCache],
    ) -> torch.Tensor:
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"got {len(kv_caches)} KV caches for {len(self.layers)} layers")
        hidden_states = self.embed_tokens(input_ids)  # [T, hidden]
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden_states = layer(positions, hidden_states, kv_cache, attn_metadata)
        return self.final_layernorm(hidden_states)


def add_lm_head_bias(lm_head: ParallelLMHead) -> None:
    """Give an LM head built without one a vocabulary-sharded bias, as
    ``ParallelLMHead(bias=True)`` would (Llama's wrapper builds the head bias-free)."""
    bias = nn.Parameter(
        torch.zeros(lm_head.num_embeddings_per_partition, dtype=lm_head.params_dtype),
        requires_grad=False,
    )  # [V_per_partition]
    set_weight_attrs(bias, {"output_dim": 0, "weight_loader": lm_head.weight_loader})
    lm_head.bias = bias


class PhiForCausalLM(LlamaForCausalLM):
    model_cls = PhiModel
    stacked_params_mapping = [
        (".qkv_proj", ".q_proj", "q"),
        (".qkv_proj", ".k_proj", "k"),
        (".qkv_proj", ".v_proj", "v"),
    ]

    def __init__(
        self, model_config: ModelConfig, quant_config: Optional[QuantizationConfig] = None
    ):
        super().__init__(model_config, quant_config)
        add_lm_head_bias(self.lm_head)  # HF's Phi lm_head always has a bias

    def init_dummy_weights(self, seed: int) -> None:
        model_utils.init_dummy_weights(self, seed)
        reset_layernorms_(self)

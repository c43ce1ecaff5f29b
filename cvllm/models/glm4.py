"""GLM-4 decoder (Glm4ForCausalLM: GLM-4-0414, GLM-Z1).

Llama's decoder (``llama.py``) with, as in transformers' ``modeling_glm4.py``:
- partial rotary (``partial_rotary_factor``, 0.5 in the released models) in GPT-J style,
  rotating interleaved pairs (x0, x1), (x2, x3)... of the first rotary dims;
- q/k/v bias from ``attention_bias``, o_proj never biased;
- a fused ``gate_up_proj`` checkpoint tensor (gate rows first), loaded as is by the
  merged gate/up linear;
- two extra norms: ``post_self_attn_layernorm`` on the attention output and
  ``post_mlp_layernorm`` on the MLP output, each before its residual add.
Built by the worker on every rank like every model class.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from cvllm.attention.kv_cache import KVCache
from cvllm.attention.metadata import AttentionMetadata
from cvllm.layers.layernorm import RMSNorm
from cvllm.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


class Glm4Attention(LlamaAttention):
    def __init__(self, config, rotary_emb, dtype, quant_config, prefix, sliding_window):
        super().__init__(
            config, rotary_emb, dtype, quant_config, prefix, sliding_window, o_bias=False
        )


class Glm4DecoderLayer(LlamaDecoderLayer):
    attention_cls = Glm4Attention
    reduce_in_norm = False  # the post-attention / post-MLP norms need whole sums

    def __init__(self, config, rotary_emb, dtype, quant_config, prefix, sliding_window):
        super().__init__(config, rotary_emb, dtype, quant_config, prefix, sliding_window)
        hidden, eps = config.get("hidden_size"), float(config.get("rms_norm_eps", 1e-6))
        self.post_self_attn_layernorm = RMSNorm(hidden, eps, dtype)
        self.post_mlp_layernorm = RMSNorm(hidden, eps, dtype)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: Optional[torch.Tensor],
        kv_cache: KVCache,
        attn_metadata: AttentionMetadata,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Like Llama's layer, the residual add is deferred into the next norm; the
        returned MLP output is already post-normed."""
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, kv_cache, attn_metadata)
        hidden_states = self.post_self_attn_layernorm(hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        hidden_states = self.post_mlp_layernorm(self.mlp(hidden_states))  # [T, hidden]
        return hidden_states, residual


class Glm4Model(LlamaModel):
    decoder_layer_cls = Glm4DecoderLayer
    rope_is_neox_style = False


class Glm4ForCausalLM(LlamaForCausalLM):
    # The checkpoint's fused ``mlp.gate_up_proj`` matches the parameter name, so it loads
    # whole (split by the merged linear's weight_loader); Llama's mapping stays for q/k/v.
    model_cls = Glm4Model

"""Qwen3 decoder (Qwen3ForCausalLM).

Llama's decoder (``llama.py``) plus, as in transformers' ``Qwen3Attention``: an RMSNorm
over each head of q and of k (``q_norm`` / ``k_norm``, weight ``[head_dim]``) applied
before rope; ``head_dim`` read from the config (it need not be hidden/heads);
``attention_bias`` on q/k/v and o alike; Qwen2's per-layer sliding windows. Built by the
worker on every rank like every model class.
"""

from __future__ import annotations

import functools
from typing import Callable, List, Optional, Tuple

import torch

from cvllm.attention.kv_cache import KVCache
from cvllm.attention.metadata import AttentionMetadata
from cvllm.config import ModelConfig
from cvllm.layers.layernorm import RMSNorm
from cvllm.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from cvllm.models.qwen2 import qwen_sliding_windows


class Qwen3Attention(LlamaAttention):
    def __init__(self, config, rotary_emb, dtype, quant_config, prefix, sliding_window):
        super().__init__(config, rotary_emb, dtype, quant_config, prefix, sliding_window)
        eps = float(config.get("rms_norm_eps", 1e-6))
        self.q_norm = RMSNorm(self.head_dim, eps, dtype)
        self.k_norm = RMSNorm(self.head_dim, eps, dtype)

    def _norm_heads(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        T = x.shape[0]
        heads = norm(x.reshape(T, -1, self.head_dim))  # [T, heads, D]
        return heads.reshape(T, -1)  # [T, heads * D]

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        kv_cache: KVCache,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)  # [T, (H + 2*Hkv) * D]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self._norm_heads(q, self.q_norm), self._norm_heads(k, self.k_norm)
        # The backend rotates q and k (in place) together with its K/V cache write.
        out = self.attn(q, k, v, kv_cache, attn_metadata, positions, self.rotary_emb)  # [T, H*D]
        return self.o_proj(out)  # [T, hidden]

    flat_forward = forward

    def qk_maps(self) -> Tuple[Optional[Callable], Optional[Callable]]:
        return (functools.partial(self._norm_heads, norm=self.q_norm),
                functools.partial(self._norm_heads, norm=self.k_norm))


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3Model(LlamaModel):
    decoder_layer_cls = Qwen3DecoderLayer


class Qwen3ForCausalLM(LlamaForCausalLM):
    model_cls = Qwen3Model

    @staticmethod
    def _sliding_window(model_config: ModelConfig) -> List[Optional[int]]:
        return qwen_sliding_windows(model_config)

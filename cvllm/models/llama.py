"""Llama-family decoder (LlamaForCausalLM; MistralForCausalLM = Llama + sliding window).

The shared blocks as they are (``models/blocks.py``, assembled by
``models/base.DecoderForCausalLM``): RMSNorm pre-norm layers, GQA attention with
``attention_bias``, a gated MLP with ``mlp_bias`` and ``hidden_act``, one rope (type,
theta, scaling, partial factor), ``tie_word_embeddings``; the row-parallel partial sums
reduced in the next RMSNorm. Built by the worker on every rank like every model class.
Families that differ only in what they declare (Qwen2, Qwen3, GLM-4, StableLM, Phi,
Qwen2/3-MoE) subclass ``LlamaForCausalLM``.
"""

from __future__ import annotations

from typing import Optional

from cvllm.config import ModelConfig
from cvllm.models.base import DecoderForCausalLM

# HF checkpoint parts fused into one parameter here: (param part, checkpoint part, shard_id)
QKV_GATE_UP_MAPPING = [
    (".qkv_proj", ".q_proj", "q"),
    (".qkv_proj", ".k_proj", "k"),
    (".qkv_proj", ".v_proj", "v"),
    (".gate_up_proj", ".gate_proj", 0),
    (".gate_up_proj", ".up_proj", 1),
]


class LlamaForCausalLM(DecoderForCausalLM):
    # tp need not divide the attention heads (balanced uneven split; the builder asks).
    uneven_tp_heads = True
    reduce_in_norm = True
    stacked_params_mapping = QKV_GATE_UP_MAPPING
    # Non-weights some checkpoints carry.
    ignored_weight_substrings = (
        "rotary_emb.inv_freq",
        "rotary_emb.cos_cached",
        "rotary_emb.sin_cached",
    )


class MistralForCausalLM(LlamaForCausalLM):
    """Llama with an optional ``sliding_window`` over the attention context."""

    def sliding_windows(self, config: ModelConfig) -> Optional[int]:
        window = config.get("sliding_window")
        return int(window) if window else None

"""Qwen3-MoE decoder (Qwen3MoeForCausalLM: Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder).

Qwen3's attention (``qwen3.py``: per-head q/k RMSNorm before rope, explicit head_dim,
``attention_bias``) with Qwen2-MoE's sparse MLP (``qwen2_moe.py``) minus the shared
expert (Qwen3-MoE configs have no ``shared_expert_intermediate_size``), as in
transformers' ``Qwen3MoeSparseMoeBlock``: softmax router, top ``num_experts_per_tok``,
renormalised when ``norm_topk_prob``; ``mlp_only_layers`` / ``decoder_sparse_step`` choose
the dense layers. With ``use_sliding_window`` every layer slides (transformers' rule).
Built by the worker on every rank like every model class.
"""

from __future__ import annotations

from typing import List, Optional

from cvllm.config import ModelConfig
from cvllm.models.qwen2_moe import Qwen2MoeForCausalLM
from cvllm.models.qwen3 import Qwen3ForCausalLM


class Qwen3MoeForCausalLM(Qwen2MoeForCausalLM):
    attention_options = Qwen3ForCausalLM.attention_options

    def sliding_windows(self, config: ModelConfig) -> List[Optional[int]]:
        # transformers' Qwen3-MoE slides every layer when use_sliding_window is set (it
        # ignores max_window_layers, which some Qwen3-MoE config.json files carry).
        window = config.get("sliding_window")
        use = config.get("use_sliding_window", False) and window
        return [int(window) if use else None] * config.num_layers

"""Qwen3 decoder (Qwen3ForCausalLM).

Llama's decoder (``llama.py``) plus, as in transformers' ``Qwen3Attention``: an RMSNorm
over each head of q and of k (``q_norm`` / ``k_norm``, weight ``[head_dim]``) applied
before rope; ``head_dim`` read from the config (it need not be hidden/heads);
``attention_bias`` on q/k/v and o alike; Qwen2's per-layer sliding windows. Built by the
worker on every rank like every model class.
"""

from __future__ import annotations

import torch

from cvllm.config import ModelConfig
from cvllm.models.blocks import GQAOptions
from cvllm.models.qwen2 import Qwen2ForCausalLM


class Qwen3ForCausalLM(Qwen2ForCausalLM):
    """Qwen2's sliding windows; its own attention."""

    def attention_options(self, config: ModelConfig, dtype: torch.dtype) -> GQAOptions:
        return GQAOptions(qk_norm=lambda head_dim, heads: self.make_norm(config, dtype, head_dim))

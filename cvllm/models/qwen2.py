"""Qwen2 decoder (Qwen2ForCausalLM: Qwen2/2.5, QwQ, DeepSeek-R1-Distill-Qwen).

Llama's decoder (``llama.py``) declaring two differences, as in transformers' ``Qwen2Attention``:
q/k/v projections always carry a bias and o_proj never does (fixed by the architecture,
not by a config flag), and layers listed as ``sliding_attention`` attend only to the last
``sliding_window`` tokens. Built by the worker on every rank like every model class.
"""

from __future__ import annotations

from typing import List, Optional

import torch

from cvllm.config import ModelConfig
from cvllm.models.blocks import GQAOptions
from cvllm.models.llama import LlamaForCausalLM


def qwen_sliding_windows(config: ModelConfig) -> List[Optional[int]]:
    """Per-layer window of the Qwen2/Qwen3 configs (None = full attention).

    transformers 5 saves ``layer_types``; older config.json files only say
    ``use_sliding_window`` and ``max_window_layers`` (layers from that index on slide).
    Without ``use_sliding_window`` the ``sliding_window`` value is ignored, as HF does.
    """
    n = config.num_layers
    window = config.get("sliding_window")
    if not config.get("use_sliding_window", False) or not window:
        return [None] * n
    types = config.get("layer_types")
    if not types:
        first = int(config.get("max_window_layers", 0) or 0)
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
    if len(types) != n:
        raise ValueError(f"config has {len(types)} layer_types for {n} layers")
    return [int(window) if t == "sliding_attention" else None for t in types]


class Qwen2ForCausalLM(LlamaForCausalLM):
    def attention_options(self, config: ModelConfig, dtype: torch.dtype) -> GQAOptions:
        return GQAOptions(qkv_bias=True, o_bias=False)

    def sliding_windows(self, config: ModelConfig) -> List[Optional[int]]:
        return qwen_sliding_windows(config)

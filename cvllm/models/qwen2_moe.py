"""Qwen2-MoE decoder (Qwen2MoeForCausalLM: Qwen1.5-MoE, Qwen2-57B-A14B).

Llama's decoder (``llama.py``) declaring, as in transformers' ``Qwen2MoeDecoderLayer``:
Qwen2's attention with the q/k/v bias read from ``qkv_bias`` (a GGUF-derived config says
``attention_bias``; default on), never an o_proj bias; the sparse MoE block
(``sparse_moe.py``: softmax router, ``norm_topk_prob``, a sigmoid-gated shared expert)
in place of the MLP unless the layer is in ``mlp_only_layers`` or off the
``decoder_sparse_step`` stride (dense layers: a gated MLP of ``intermediate_size``).
Built by the worker on every rank like every model class.
"""

from __future__ import annotations

from typing import Iterable, Iterator, List, Optional, Tuple

import torch
from torch import nn

from cvllm.config import ModelConfig
from cvllm.layers.utils import as_tensor
from cvllm.models.blocks import GatedMLP, GQAOptions
from cvllm.models.llama import LlamaForCausalLM
from cvllm.models.sparse_moe import SparseMoeBlock, is_sparse_layer, moe_activation
from cvllm.quantization.base import QuantizationConfig


def num_routed_experts(config: ModelConfig) -> int:
    """transformers 5 saves Qwen3-MoE's ``num_experts`` as ``num_local_experts`` (its
    attribute map); Hub config.json files spell it ``num_experts``."""
    return int(config.get("num_experts") or config.get("num_local_experts") or 0)


def qwen2_moe_sliding_windows(config: ModelConfig) -> List[Optional[int]]:
    """Per-layer windows: config ``layer_types`` when saved, else transformers'
    Qwen2-MoE default (every other layer below ``max_window_layers`` slides)."""
    n, window = config.num_layers, config.get("sliding_window")
    if not config.get("use_sliding_window", False) or not window:
        return [None] * n
    types = config.get("layer_types")
    if not types:
        first_full = int(config.get("max_window_layers", n) or 0)
        types = ["sliding_attention" if (i + 1) % 2 and i < first_full else "full_attention"
                 for i in range(n)]
    if len(types) != n:
        raise ValueError(f"config has {len(types)} layer_types for {n} layers")
    return [int(window) if t == "sliding_attention" else None for t in types]


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    reduce_in_norm = False  # the sparse block reduces inside
    has_experts = True

    def attention_options(self, config: ModelConfig, dtype: torch.dtype) -> GQAOptions:
        qkv_bias = config.get("qkv_bias")
        if qkv_bias is None:
            qkv_bias = config.get("attention_bias", True)
        return GQAOptions(qkv_bias=bool(qkv_bias), o_bias=False)

    def make_mlp(self, config: ModelConfig, layer_idx: int, dtype: torch.dtype,
                 quant_config: Optional[QuantizationConfig], prefix: str) -> nn.Module:
        act = config.get("hidden_act", "silu")
        if is_sparse_layer(config, layer_idx, num_routed_experts(config)):
            return SparseMoeBlock(config, dtype, quant_config, prefix,
                                  num_experts=num_routed_experts(config),
                                  renormalize=bool(config.get("norm_topk_prob", False)),
                                  activation=moe_activation(act))
        return GatedMLP(config.get("hidden_size"), int(config.get("intermediate_size")), act,
                        dtype, quant_config, prefix)

    def sliding_windows(self, config: ModelConfig) -> List[Optional[int]]:
        return qwen2_moe_sliding_windows(config)

    def checkpoint_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> Iterator:
        """GGUF files hold ``shared_expert_gate`` as a vector ``[H]`` (llama.cpp's
        ``ffn_gate_inp_shexp``); the linear needs ``[1, H]``."""
        for name, tensor in weights:
            if name.endswith("shared_expert_gate.weight") and tensor.dim() == 1:
                tensor = as_tensor(tensor).unsqueeze(0)  # [1, H]; replicated, read whole
            yield name, tensor

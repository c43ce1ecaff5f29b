"""Phi-2 decoder (PhiForCausalLM).

As in transformers' ``PhiDecoderLayer``: one LayerNorm (with bias) feeds attention and the
MLP in parallel (the shared blocks' parallel layout: ``out = (attn(ln(x)) + mlp(ln(x))) +
x``, HF's order of the adds); q/k/v, ``dense`` (the output projection), ``fc1``/``fc2``
and the LM head all carry biases; rope covers the first ``partial_rotary_factor`` of each
head; the MLP is ungated (``hidden_act``, gelu_new for Phi-2); an optional
``qk_layernorm`` (one LayerNorm over head_dim shared by all heads) precedes rope; the
final norm is ``final_layernorm``. Declared on Llama's causal LM, plus the LM head bias.
Built by the worker on every rank like every model class.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from cvllm.config import ModelConfig
from cvllm.layers.activation import get_act_fn
from cvllm.layers.embedding import ParallelLMHead
from cvllm.layers.layernorm import LayerNorm
from cvllm.layers.linear import ColumnParallelLinear, RowParallelLinear
from cvllm.models import utils as model_utils
from cvllm.models.blocks import GQAOptions
from cvllm.models.llama import QKV_GATE_UP_MAPPING, LlamaForCausalLM
from cvllm.quantization.base import QuantizationConfig, set_weight_attrs


def reset_layernorms_(model: nn.Module) -> None:
    """Dummy weights: LayerNorms back to identity (the shared init draws them at random)."""
    for module in model.modules():
        if isinstance(module, LayerNorm):
            module.reset_parameters()


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
    # One input norm, no mlp_norm: the parallel residual.
    layer_names = (("input_norm", "input_layernorm"), ("attention", "self_attn"), ("mlp", "mlp"))
    final_norm_name = "final_layernorm"
    norm_cls = LayerNorm
    norm_eps = ("layer_norm_eps", 1e-5)
    reduce_in_norm = False
    stacked_params_mapping = QKV_GATE_UP_MAPPING[:3]

    def attention_options(self, config: ModelConfig, dtype: torch.dtype) -> GQAOptions:
        qk_norm = (lambda head_dim, heads: self.make_norm(config, dtype, head_dim))
        return GQAOptions(qkv_bias=True, o_bias=True, o_proj_name="dense",
                          qk_norm=qk_norm if config.get("qk_layernorm", False) else None,
                          qk_norm_names=("q_layernorm", "k_layernorm"))

    def make_mlp(self, config: ModelConfig, layer_idx: int, dtype: torch.dtype,
                 quant_config: Optional[QuantizationConfig], prefix: str) -> nn.Module:
        return PhiMLP(config, dtype, quant_config, prefix)

    def __init__(
        self, model_config: ModelConfig, quant_config: Optional[QuantizationConfig] = None
    ):
        super().__init__(model_config, quant_config)
        add_lm_head_bias(self.lm_head)  # HF's Phi lm_head always has a bias

    def init_dummy_weights(self, seed: int) -> None:
        model_utils.init_dummy_weights(self, seed)
        reset_layernorms_(self)

"""Qwen2-MoE decoder (Qwen2MoeForCausalLM: Qwen1.5-MoE, Qwen2-57B-A14B).

Qwen2's attention (q/k/v bias per ``qkv_bias``, no o bias) with a mixture-of-experts MLP in
the sparse layers, as in transformers' ``Qwen2MoeSparseMoeBlock``: a softmax router
(``mlp.gate``) picks ``num_experts_per_tok`` of ``num_experts`` experts (weights
renormalised when ``norm_topk_prob``), the routed experts run as one ``FusedMoE``, and a
shared expert (``shared_expert_intermediate_size``) is added, scaled by
``sigmoid(shared_expert_gate(x))``. A layer is sparse unless it is in ``mlp_only_layers``
or ``(i + 1) % decoder_sparse_step != 0``; dense layers use an MLP of
``intermediate_size``. ``Qwen2MoeSparseMoeBlock`` is shared with ``qwen3_moe.py`` (no
shared expert there). Built by the worker on every rank like every model class.
"""

from __future__ import annotations

from typing import Iterable, List, Optional, Set, Tuple

import torch
from torch import nn

from cvllm.config import ModelConfig
from cvllm.layers.activation import get_act_and_mul_fn
from cvllm.layers.layernorm import RMSNorm
from cvllm.layers.linear import MergedColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from cvllm.layers.moe import FusedMoE, select_experts
from cvllm.layers.utils import as_tensor
from cvllm.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from cvllm.models.moe_utils import load_moe_model_weights
from cvllm.quantization.base import QuantizationConfig

# hidden_act -> FusedMoE activation
_MOE_ACT = {"silu": "silu", "swish": "silu", "gelu": "gelu"}


class Qwen2MoeMLP(nn.Module):
    """Gated MLP of an explicit width (dense layers, the shared expert); no biases."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str,
                 dtype: torch.dtype, quant_config: Optional[QuantizationConfig], prefix: str):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size] * 2, bias=False, params_dtype=dtype,
            quant_config=quant_config, prefix=f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(
            intermediate_size, hidden_size, bias=False, params_dtype=dtype,
            quant_config=quant_config, prefix=f"{prefix}.down_proj")
        self.act_fn = get_act_and_mul_fn(hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj(x), act_fn=self.act_fn)  # [T, hidden]


class Qwen2MoeSparseMoeBlock(nn.Module):
    """Router + routed experts (+ the sigmoid-gated shared expert when its size > 0)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype,
                 quant_config: Optional[QuantizationConfig], prefix: str):
        super().__init__()
        hidden, act = config.get("hidden_size"), config.get("hidden_act", "silu")
        if act not in _MOE_ACT:
            raise ValueError(f"unsupported MoE hidden_act {act!r}; supported: {sorted(_MOE_ACT)}")
        num_experts, self.top_k = num_routed_experts(config), int(config.get("num_experts_per_tok"))
        self.norm_topk_prob = bool(config.get("norm_topk_prob", False))
        # The router stays unquantized (as in vLLM): its logits decide the routing.
        self.gate = ReplicatedLinear(hidden, num_experts, bias=False, params_dtype=dtype,
                                     prefix=f"{prefix}.gate")
        self.experts = FusedMoE(num_experts, self.top_k, hidden,
                                int(config.get("moe_intermediate_size")), dtype,
                                prefix=f"{prefix}.experts", activation=_MOE_ACT[act],
                                quant_config=quant_config)
        shared = int(config.get("shared_expert_intermediate_size", 0) or 0)
        self.shared_expert: Optional[Qwen2MoeMLP] = None
        if shared > 0:
            self.shared_expert = Qwen2MoeMLP(hidden, shared, act, dtype, quant_config,
                                             f"{prefix}.shared_expert")
            self.shared_expert_gate = ReplicatedLinear(hidden, 1, bias=False, params_dtype=dtype,
                                                       prefix=f"{prefix}.shared_expert_gate")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        router_logits = self.gate(x)  # [T, E]
        topk_weights, topk_ids = select_experts(router_logits, self.top_k, self.norm_topk_prob)
        out = self.experts(x, topk_weights, topk_ids)  # [T, hidden]
        if self.shared_expert is not None:
            gate = torch.sigmoid(self.shared_expert_gate(x))  # [T, 1]
            out = out + gate * self.shared_expert(x)
        return out


def num_routed_experts(config: ModelConfig) -> int:
    """transformers 5 saves Qwen3-MoE's ``num_experts`` as ``num_local_experts`` (its
    attribute map); Hub config.json files spell it ``num_experts``."""
    return int(config.get("num_experts") or config.get("num_local_experts") or 0)


def is_sparse_layer(config: ModelConfig, layer_idx: int) -> bool:
    """transformers' rule for Qwen2/3-MoE: experts unless listed in ``mlp_only_layers`` or
    off the ``decoder_sparse_step`` stride."""
    step = int(config.get("decoder_sparse_step", 1) or 1)
    return (layer_idx not in (config.get("mlp_only_layers") or [])
            and num_routed_experts(config) > 0 and (layer_idx + 1) % step == 0)


def moe_or_dense_mlp(config: ModelConfig, dtype: torch.dtype,
                     quant_config: Optional[QuantizationConfig], prefix: str) -> nn.Module:
    """The MLP of the decoder layer named ``prefix`` (``model.layers.{i}``)."""
    layer_idx = int(prefix.rsplit(".", 1)[-1])
    if is_sparse_layer(config, layer_idx):
        return Qwen2MoeSparseMoeBlock(config, dtype, quant_config, f"{prefix}.mlp")
    return Qwen2MoeMLP(config.get("hidden_size"), int(config.get("intermediate_size")),
                       config.get("hidden_act", "silu"), dtype, quant_config, f"{prefix}.mlp")


class Qwen2MoeAttention(LlamaAttention):
    """Qwen2's attention with the q/k/v bias read from ``qkv_bias`` (transformers' flag;
    a GGUF-derived config says ``attention_bias``), never an o_proj bias."""

    def __init__(self, config, rotary_emb, dtype, quant_config, prefix, sliding_window):
        qkv_bias = config.get("qkv_bias")
        if qkv_bias is None:
            qkv_bias = config.get("attention_bias", True)
        super().__init__(config, rotary_emb, dtype, quant_config, prefix, sliding_window,
                         qkv_bias=bool(qkv_bias), o_bias=False)


class Qwen2MoeDecoderLayer(LlamaDecoderLayer):
    """Llama's pre-norm residual layer (its forward) with a sparse or dense MLP."""

    attention_cls = Qwen2MoeAttention
    reduce_in_norm = False  # the sparse block reduces inside; its __init__ is not Llama's

    def __init__(self, config: ModelConfig, rotary_emb, dtype: torch.dtype,
                 quant_config: Optional[QuantizationConfig], prefix: str,
                 sliding_window: Optional[int]):
        # Not LlamaDecoderLayer.__init__: it would allocate a dense MLP first.
        nn.Module.__init__(self)
        hidden, eps = config.get("hidden_size"), float(config.get("rms_norm_eps", 1e-6))
        self.self_attn = self.attention_cls(
            config, rotary_emb, dtype, quant_config, f"{prefix}.self_attn", sliding_window)
        self.mlp = moe_or_dense_mlp(config, dtype, quant_config, prefix)
        self.input_layernorm = RMSNorm(hidden, eps, dtype)
        self.post_attention_layernorm = RMSNorm(hidden, eps, dtype)


class Qwen2MoeModel(LlamaModel):
    decoder_layer_cls = Qwen2MoeDecoderLayer


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
    model_cls = Qwen2MoeModel

    @staticmethod
    def _sliding_window(model_config: ModelConfig) -> List[Optional[int]]:
        return qwen2_moe_sliding_windows(model_config)

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> Set[str]:
        """HF-named tensors, experts per expert or stacked (see ``moe_utils``)."""
        skip = ("lm_head.weight",) if self.tie_word_embeddings else ()
        return load_moe_model_weights(self, _shared_gate_as_row(weights),
                                      self.stacked_params_mapping,
                                      self.ignored_weight_substrings, skip)


def _shared_gate_as_row(weights: Iterable[Tuple[str, torch.Tensor]]):
    """GGUF files hold ``shared_expert_gate`` as a vector ``[H]`` (llama.cpp's
    ``ffn_gate_inp_shexp``); the linear needs ``[1, H]``."""
    for name, tensor in weights:
        if name.endswith("shared_expert_gate.weight") and tensor.dim() == 1:
            tensor = as_tensor(tensor).unsqueeze(0)  # [1, H]; replicated, read whole
        yield name, tensor

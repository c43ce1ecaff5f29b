"""DeepSeek V2 / V3 decoder (DeepseekV2ForCausalLM, DeepseekV3ForCausalLM): multi-head
latent attention over a compressed KV cache, and mixture-of-experts layers with grouped
top-k routing, shared experts and a routed scaling factor after ``first_k_dense_replace``
dense layers.

Built by the worker on every rank (``get_model_class(arch)(model_config)``), holding this
rank's weight shards; it owns no cache. ``cache_specs()`` tells the worker to allocate one
``MLASpec`` cache per layer, ``[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]``,
passed back each step as ``kv_caches[i] = (kv_cache, None)``.

The two versions differ only where transformers' classes differ (``DeepseekVariant``):

- V2: softmax router; ``topk_method`` ``greedy`` (no groups) or ``group_limited_greedy``
  (``n_group`` / ``topk_group``, a group scores by its best expert); rope on interleaved
  pairs; ``mlp_bias`` honoured.
- V3: sigmoid router with ``e_score_correction_bias`` and groups always on (``noaux_tc``);
  rope interleaved unless ``rope_interleave`` is false (then rotate-half).

Both honour ``norm_topk_prob`` (transformers' V2 router ignores it; every released V2
checkpoint has it false, and DeepSeek's own V2 code and vLLM apply it) and
``moe_layer_freq`` (absent from transformers; 1 in every released checkpoint).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Iterator, List, Optional, Set, Tuple

import torch
from torch import nn

from cvllm.attention.specs import MLASpec
from cvllm.config import ModelConfig
from cvllm.layers.mla import MultiHeadLatentAttention, mla_softmax_scale
from cvllm.layers.moe import FusedMoE, select_experts
from cvllm.layers.rotary import get_rope, rope_parameters_from_config
from cvllm.models import utils as model_utils
from cvllm.models.base import DecoderForCausalLM, LayerPlan
from cvllm.models.blocks import GatedMLP, GQAOptions
from cvllm.quantization.base import QuantizationConfig


@dataclass(frozen=True)
class DeepseekVariant:
    """The settings in which V2 and V3 differ, read from the config once."""

    scoring_func: str
    """Router score: ``softmax`` (V2) or ``sigmoid`` (V3)."""
    use_score_bias: bool
    """V3's ``e_score_correction_bias``: added to the scores to choose experts only."""
    grouped: bool
    """Route within the ``topk_group`` best of ``n_group`` expert groups."""
    rope_interleave: bool
    """Rope on interleaved pairs (x0, x1), (x2, x3)... rather than rotate-half."""


class DeepseekRouter(nn.Module):
    """The router (HF ``mlp.gate``): float32 logits from a float32 weight, as transformers
    computes them whatever the model dtype; V3 adds ``e_score_correction_bias``."""

    def __init__(self, hidden: int, num_experts: int, use_score_bias: bool):
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(num_experts, hidden, dtype=torch.float32), requires_grad=False
        )  # [E, hidden]
        if use_score_bias:
            self.e_score_correction_bias = nn.Parameter(
                torch.zeros(num_experts, dtype=torch.float32), requires_grad=False
            )  # [E]
        else:
            self.e_score_correction_bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x.float(), self.weight)  # [T, E] float32


class DeepseekV2MoE(nn.Module):
    def __init__(
        self, config: ModelConfig, variant: DeepseekVariant, dtype, quant_config, prefix: str
    ):
        super().__init__()
        hidden, inter = config.get("hidden_size"), config.get("moe_intermediate_size")
        num_experts = int(config.get("n_routed_experts"))
        self.top_k = int(config.get("num_experts_per_tok"))
        self.renormalize = bool(config.get("norm_topk_prob", False))
        self.routed_scaling_factor = float(config.get("routed_scaling_factor", 1.0))
        self.scoring_func = variant.scoring_func
        self.num_expert_group = config.get("n_group") if variant.grouped else None
        self.topk_group = config.get("topk_group") if variant.grouped else None
        act = config.get("hidden_act", "silu")
        self.gate = DeepseekRouter(hidden, num_experts, variant.use_score_bias)
        self.experts = FusedMoE(
            num_experts, self.top_k, hidden, inter, dtype, f"{prefix}.experts", activation=act,
            quant_config=quant_config,
        )
        n_shared = int(config.get("n_shared_experts") or 0)
        self.shared_experts = (
            GatedMLP(hidden, inter * n_shared, act, dtype, quant_config,
                     f"{prefix}.shared_experts", bias=bool(config.get("mlp_bias", False)))
            if n_shared
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = select_experts(
            self.gate(x),
            self.top_k,
            self.renormalize,
            self.scoring_func,
            self.gate.e_score_correction_bias,
            self.num_expert_group,
            self.topk_group,
            self.routed_scaling_factor,
        )  # [T, K] each
        out = self.experts(x, topk_weights, topk_ids)  # [T, hidden]
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


def is_moe_layer(config: ModelConfig, layer_idx: int) -> bool:
    if not config.get("n_routed_experts"):
        return False
    first_dense = int(config.get("first_k_dense_replace") or 0)
    return layer_idx >= first_dense and layer_idx % int(config.get("moe_layer_freq") or 1) == 0


class DeepseekV2ForCausalLM(DecoderForCausalLM):
    has_experts = True
    # HF checkpoint parts fused into one parameter here: (param part, checkpoint part, shard_id)
    stacked_params_mapping = [
        (".gate_up_proj", ".gate_proj", 0),
        (".gate_up_proj", ".up_proj", 1),
        (".kv_b_proj", ".k_b_proj", "k_b"),  # llama.cpp's split kv_b (see layers/mla.py)
        (".kv_b_proj", ".v_b_proj", "v_b"),
    ]
    ignored_weight_substrings = (
        "rotary_emb.inv_freq",
        "rotary_emb.cos_cached",
        "rotary_emb.sin_cached",
    )

    def __init__(self, model_config: ModelConfig,
                 quant_config: Optional[QuantizationConfig] = None):
        super().__init__(model_config, quant_config)
        self.variant = self.variant_of(model_config)

    def layer_plans(self, config: ModelConfig) -> List[LayerPlan]:
        rope = get_rope(int(config.get("qk_rope_head_dim")), config.max_model_len,
                        rope_parameters_from_config(config.hf_config), config.native_max_len,
                        is_neox_style=not self.variant_of(config).rope_interleave)
        return [LayerPlan(rope)] * config.num_layers

    def make_attention(self, config: ModelConfig, plan: LayerPlan, options: GQAOptions,
                       dtype: torch.dtype, quant_config: Optional[QuantizationConfig],
                       prefix: str) -> nn.Module:
        nope, rope = int(config.get("qk_nope_head_dim")), int(config.get("qk_rope_head_dim"))
        q_lora = config.get("q_lora_rank")
        return MultiHeadLatentAttention(
            config.get("hidden_size"),
            config.num_heads,
            nope,
            rope,
            int(config.get("v_head_dim")),
            int(q_lora) if q_lora else None,
            int(config.get("kv_lora_rank")),
            plan.rotary_emb,
            mla_softmax_scale(nope + rope, rope_parameters_from_config(config.hf_config)),
            bool(config.get("attention_bias", False)),
            dtype,
            quant_config,
            prefix,
        )

    def make_mlp(self, config: ModelConfig, layer_idx: int, dtype: torch.dtype,
                 quant_config: Optional[QuantizationConfig], prefix: str) -> nn.Module:
        if is_moe_layer(config, layer_idx):
            return DeepseekV2MoE(config, self.variant_of(config), dtype, quant_config, prefix)
        return GatedMLP(config.get("hidden_size"), config.get("intermediate_size"),
                        config.get("hidden_act", "silu"), dtype, quant_config, prefix,
                        bias=bool(config.get("mlp_bias", False)))

    @staticmethod
    def variant_of(config: ModelConfig) -> DeepseekVariant:
        return DeepseekVariant(
            scoring_func=config.get("scoring_func") or "softmax",
            use_score_bias=False,
            grouped=config.get("topk_method") == "group_limited_greedy",
            rope_interleave=True,
        )

    def cache_specs(self) -> List[MLASpec]:
        """One compressed (latent + rope key) cache per layer."""
        spec = MLASpec(
            int(self.config.get("kv_lora_rank")),
            int(self.config.get("qk_rope_head_dim")),
            self.dtype,
        )
        return [spec] * self.config.num_layers

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> Set[str]:
        """Load HF-named tensors (experts per expert or stacked; ``kv_b_proj`` fused or as
        llama.cpp's ``k_b_proj`` / ``v_b_proj``); raises ``WeightLoadError`` listing unknown
        or missing ones."""
        seen = super().load_weights(weights)
        self._after_loading()
        return seen

    def checkpoint_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> Iterator:
        return _canonical(weights, self.config.num_layers)

    def init_dummy_weights(self, seed: int) -> None:
        model_utils.init_dummy_weights(self, seed)
        self._after_loading()

    def _after_loading(self) -> None:
        for module in self.modules():
            if isinstance(module, MultiHeadLatentAttention):
                module.process_weights_after_loading()


_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.")


def _canonical(
    weights: Iterable[Tuple[str, torch.Tensor]], num_layers: int
) -> Iterator[Tuple[str, torch.Tensor]]:
    """Drop multi-token-prediction layers (``model.layers.{n >= num_hidden_layers}`` in V3
    checkpoints: only next-token decoding is served) and spell llama.cpp's
    ``exp_probs_b.bias`` (``e_score_correction.bias``) as HF does."""
    for name, tensor in weights:
        m = _LAYER_RE.match(name)
        if m is not None and int(m.group(1)) >= num_layers:
            continue
        yield name.replace("e_score_correction.bias", "e_score_correction_bias"), tensor


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """V3: sigmoid + bias-corrected grouped routing (``noaux_tc``), optional rotate-half rope."""

    @staticmethod
    def variant_of(config: ModelConfig) -> DeepseekVariant:
        interleave = config.get("rope_interleave")
        return DeepseekVariant(
            scoring_func=config.get("scoring_func") or "sigmoid",
            use_score_bias=True,
            grouped=True,
            rope_interleave=True if interleave is None else bool(interleave),
        )

"""The causal-LM wrapper every model family shares (``CausalLMBase``: a decoder stack
``self.model``, an LM head with its logits processor, HF-named weight loading), and the
decoder-only family built from the shared blocks (``DecoderForCausalLM``).

Built by the worker on every rank (``get_model_class(arch)(model_config)``, under the
target ``torch.device`` context), holding this rank's weight shards; it owns no KV cache.
``forward(input_ids, positions, attn_metadata, kv_caches)`` takes the worker's per-layer
cache entries explicitly each step, so CUDA-graph capture and several engines in one
process need no binding step. Subclasses set ``stacked_params_mapping`` (HF shard name ->
fused parameter), ``ignored_weight_substrings`` and ``has_experts``; families whose
checkpoints differ override ``checkpoint_weights``.

A family on ``DecoderForCausalLM`` declares only what differs from Llama, every setting
read from the config (DESIGN rule 10): class attributes (``layer_names``: the checkpoint's
names of a layer's parts, whose norms are its residual layout; ``norm_cls``;
``rope_is_neox_style``; ``reduce_in_norm``) and the hooks ``layer_plans`` (rope and window
per layer), ``attention_options``, ``make_attention``, ``make_mlp``, ``make_norm``,
``names_of``, ``embed_scale``, ``logits_soft_cap``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, List, Optional, Sequence, Set, Tuple, Type, Union

import torch
from torch import nn

from cvllm.attention.metadata import AttentionMetadata
from cvllm.config import ModelConfig
from cvllm.layers.embedding import LogitsProcessor, ParallelLMHead
from cvllm.layers.layernorm import RMSNorm
from cvllm.layers.rotary import RotaryEmbedding, get_rope, rope_parameters_from_config
from cvllm.layers.utils import torch_dtype
from cvllm.models import utils as model_utils
from cvllm.models.moe_utils import ExpertWeights
from cvllm.models.blocks import (LLAMA_LAYER, NORM_ROLES, DecoderLayer, DecoderModel,
                                 GatedMLP, GQAAttention, GQAOptions, LayerNames)
from cvllm.quantization.base import QuantizationConfig


class CausalLMBase(nn.Module):
    tie_word_embeddings: bool = False
    stacked_params_mapping: Sequence[Tuple[str, str, object]] = ()
    ignored_weight_substrings: Sequence[str] = ()
    has_experts = False
    """``FusedMoE`` layers: expert tensors load per expert or stacked (``moe_utils``)."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata, kv_caches: Sequence) -> torch.Tensor:
        """``input_ids [T]``, ``positions [T]`` -> hidden states ``[T, hidden]``; updates
        each layer's cache entry in ``kv_caches`` (K/V, latents or state slots)."""
        return self.model(input_ids, positions, attn_metadata, kv_caches)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[S, hidden] -> [S, vocab]`` float32 (soft-capped where the config says so)."""
        return self.logits_processor(self.lm_head, hidden_states)

    def init_lm_head(self, config: ModelConfig, dtype: torch.dtype,
                     quant_config: Optional[QuantizationConfig], tie_default: bool = False,
                     soft_cap: Optional[float] = None) -> None:
        """The LM head (tied to ``self.model.embed_tokens`` where the config says so, by
        default ``tie_default``) and the logits processor; after ``self.model``."""
        self.tie_word_embeddings = bool(config.get("tie_word_embeddings", tie_default))
        self.lm_head = ParallelLMHead(config.vocab_size, config.get("hidden_size"),
                                      params_dtype=dtype, prefix="lm_head",
                                      quant_config=quant_config)
        if self.tie_word_embeddings:
            self.lm_head.tie_weights(self.model.embed_tokens)
        self.logits_processor = LogitsProcessor(config.vocab_size, soft_cap=soft_cap)

    def _skipped_weights(self) -> Tuple[str, ...]:
        return ("lm_head.weight",) if self.tie_word_embeddings else ()

    def checkpoint_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> Iterable:
        """The checkpoint's tensors as this model names and shapes them (a family whose
        checkpoints differ renames, stacks or drops some here)."""
        return weights

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> Set[str]:
        """Load HF-named tensors (``model.layers.0.self_attn.q_proj.weight``, ...); raises
        ``WeightLoadError`` listing unknown or missing ones."""
        return model_utils.load_weights_with_mapping(
            self, self.checkpoint_weights(weights), self.stacked_params_mapping,
            self.ignored_weight_substrings, self._skipped_weights(),
            experts=ExpertWeights() if self.has_experts else None,
        )

    def init_dummy_weights(self, seed: int) -> None:
        model_utils.init_dummy_weights(self, seed)


@dataclass(frozen=True)
class LayerPlan:
    """What may differ from one decoder layer to the next; built by ``layer_plans``."""

    rotary_emb: Optional[RotaryEmbedding]
    sliding_window: Optional[int] = None
    """None: full attention."""
    kind: str = "full_attention"
    """Hybrid stacks (Qwen3-Next): ``linear_attention`` for a state layer."""


Windows = Union[None, int, Sequence[Optional[int]]]


class DecoderForCausalLM(CausalLMBase):
    """A decoder-only causal LM from ``models/blocks.py``; as is, Llama's (see the
    module docstring for what a family declares)."""

    layer_names: LayerNames = LLAMA_LAYER
    """The checkpoint's names of a layer's parts; the norms listed are its layout."""
    final_norm_name = "norm"
    norm_cls: Type[nn.Module] = RMSNorm
    norm_eps: Tuple[str, float] = ("rms_norm_eps", 1e-6)
    """The config key of the norms' epsilon, and its default."""
    rope_is_neox_style = True
    """False: GPT-J rope rotating interleaved pairs (GLM-4), not rotate-half."""
    reduce_in_norm = False
    """Row-parallel outputs summed by the next RMSNorm (``DecoderLayer``)."""
    tie_default = False
    """``tie_word_embeddings`` when the config leaves it out."""

    def __init__(self, model_config: ModelConfig,
                 quant_config: Optional[QuantizationConfig] = None):
        super().__init__()
        self.config = model_config
        self.dtype = dtype = torch_dtype(model_config.dtype)
        plans = self.layer_plans(model_config)
        if len(plans) != model_config.num_layers:
            raise ValueError(f"{len(plans)} layer plans for {model_config.num_layers} layers")
        hidden = model_config.get("hidden_size")
        options = self.attention_options(model_config, dtype)
        self.model = DecoderModel(
            model_config, dtype, quant_config,
            lambda i, prefix: self.decoder_layer(model_config, plans[i], options, i, dtype,
                                                 quant_config, prefix),
            lambda: self.make_norm(model_config, dtype, hidden),
            embed_scale=self.embed_scale(model_config, dtype), norm_name=self.final_norm_name)
        self.init_lm_head(model_config, dtype, quant_config, self.tie_default,
                          self.logits_soft_cap(model_config))

    # ---------------------------------------------------------------- what families declare
    def sliding_windows(self, config: ModelConfig) -> Windows:
        """One window for all layers, or one per layer (None = full attention)."""
        return None

    def rotary_embedding(self, config: ModelConfig) -> RotaryEmbedding:
        return get_rope(config.head_dim, config.max_model_len,
                        rope_parameters_from_config(config.hf_config), config.native_max_len,
                        is_neox_style=self.rope_is_neox_style)

    def layer_plans(self, config: ModelConfig) -> List[LayerPlan]:
        """One rope for every layer, with ``sliding_windows``."""
        rope, windows = self.rotary_embedding(config), self.sliding_windows(config)
        if not isinstance(windows, (list, tuple)):
            windows = [windows] * config.num_layers
        if len(windows) != config.num_layers:
            raise ValueError(f"{len(windows)} sliding windows for {config.num_layers} layers")
        return [LayerPlan(rope, window) for window in windows]

    def attention_options(self, config: ModelConfig, dtype: torch.dtype) -> GQAOptions:
        """The GQA attention's declarations (read once per model)."""
        return GQAOptions()

    def make_attention(self, config: ModelConfig, plan: LayerPlan, options: GQAOptions,
                       dtype: torch.dtype, quant_config: Optional[QuantizationConfig],
                       prefix: str) -> nn.Module:
        return GQAAttention(config, plan.rotary_emb, dtype, quant_config, prefix,
                            plan.sliding_window, options)

    def make_mlp(self, config: ModelConfig, layer_idx: int, dtype: torch.dtype,
                 quant_config: Optional[QuantizationConfig], prefix: str) -> nn.Module:
        return GatedMLP(config.get("hidden_size"), config.get("intermediate_size"),
                        config.get("hidden_act", "silu"), dtype, quant_config, prefix,
                        bias=bool(config.get("mlp_bias", False)))

    def make_norm(self, config: ModelConfig, dtype: torch.dtype, size: int) -> nn.Module:
        key, default = self.norm_eps
        return self.norm_cls(size, float(config.get(key, default)), dtype)

    def names_of(self, config: ModelConfig, plan: LayerPlan) -> LayerNames:
        """A layer's ``layer_names``: where they differ from layer to layer."""
        return self.layer_names

    def embed_scale(self, config: ModelConfig, dtype: torch.dtype) -> Optional[float]:
        return None

    def logits_soft_cap(self, config: ModelConfig) -> Optional[float]:
        return None

    # ------------------------------------------------------------------------------ build
    def decoder_layer(self, config: ModelConfig, plan: LayerPlan, options: GQAOptions,
                      layer_idx: int, dtype: torch.dtype,
                      quant_config: Optional[QuantizationConfig], prefix: str) -> DecoderLayer:
        """Layer ``layer_idx``: attention, MLP, then its norms (built in that order: a
        quantization budget is granted first come first served)."""
        ordered = self.names_of(config, plan)
        names = dict(ordered)
        parts = {"attention": self.make_attention(config, plan, options, dtype, quant_config,
                                                  f"{prefix}.{names['attention']}"),
                 "mlp": self.make_mlp(config, layer_idx, dtype, quant_config,
                                      f"{prefix}.{names['mlp']}")}
        for role in NORM_ROLES:
            if role in names:
                parts[role] = self.make_norm(config, dtype, config.get("hidden_size"))
        return DecoderLayer(parts, ordered, self.reduce_in_norm)

"""Gemma 2 decoder (Gemma2ForCausalLM); ``gemma3.py`` builds Gemma 3 on these classes.

Built by the worker on every rank like every model class, from the shared blocks
(``models/blocks.py``). What sets the family apart from Llama, each read from the config
(DESIGN rule 10), with transformers' own defaults for keys a config.json leaves out:

- embeddings multiplied by sqrt(hidden_size), that factor first rounded to the model dtype
  (HF keeps it as a tensor of the weights' dtype);
- four Gemma RMSNorms per layer (scale ``1 + weight``): input, post-attention,
  pre-feedforward, post-feedforward; each sub-block's output is normed before its
  residual add (the shared blocks' sandwich layout);
- a gated MLP with ``hidden_activation`` (GELU-tanh);
- attention scaled by ``query_pre_attn_scalar ** -0.5`` rather than head_dim's;
- ``attn_logit_softcapping`` on attention scores and ``final_logit_softcapping`` on the
  logits, both ``tanh(x / cap) * cap``;
- sliding-window and global layers (``layer_types``, else every
  ``sliding_window_pattern``-th layer global). HF's window: a query sees the
  ``sliding_window`` latest positions, its own included, as the attention backends do.
  ``cache_specs()`` tells the worker which layers need only their window's blocks.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from cvllm.attention.specs import FullAttentionSpec, LayerCacheSpec, SlidingWindowSpec
from cvllm.config import ModelConfig
from cvllm.layers.layernorm import GemmaRMSNorm
from cvllm.layers.rotary import RotaryEmbedding
from cvllm.layers.utils import torch_dtype
from cvllm.models.base import DecoderForCausalLM, LayerPlan
from cvllm.models.blocks import GatedMLP, GQAOptions, LayerNames
from cvllm.models.llama import QKV_GATE_UP_MAPPING
from cvllm.quantization.base import QuantizationConfig

SLIDING, FULL = "sliding_attention", "full_attention"


def gemma_layer_types(config: ModelConfig, default_pattern: int) -> List[str]:
    """Each layer's HF type, ``sliding_attention`` or ``full_attention``: the config's
    ``layer_types``, or else (older configs) every ``sliding_window_pattern``-th layer
    global, as transformers derives them."""
    n = config.num_layers
    types = config.get("layer_types")
    if types is not None:
        if len(types) != n or any(t not in (SLIDING, FULL) for t in types):
            raise ValueError(f"layer_types must list {n} of {SLIDING!r} / {FULL!r}, got {types!r}")
        return list(types)
    pattern = int(config.get("sliding_window_pattern") or default_pattern)
    return [SLIDING if (i + 1) % pattern else FULL for i in range(n)]


GEMMA_LAYER: LayerNames = (("attention", "self_attn"), ("mlp", "mlp"),
                           ("input_norm", "input_layernorm"),
                           ("attn_out_norm", "post_attention_layernorm"),
                           ("mlp_norm", "pre_feedforward_layernorm"),
                           ("mlp_out_norm", "post_feedforward_layernorm"))


class Gemma2ForCausalLM(DecoderForCausalLM):
    uneven_tp_heads = True  # tp need not divide the attention heads (the builder asks)
    layer_names = GEMMA_LAYER
    norm_cls = GemmaRMSNorm
    tie_default = True
    # transformers' Gemma2Config defaults, for keys a config.json leaves out.
    default_sliding_window_pattern = 2
    default_final_logit_softcapping: Optional[float] = 30.0
    default_attn_logit_softcapping: Optional[float] = 50.0
    default_sliding_window = 4096
    qk_norm = False
    """Gemma 3: a Gemma RMSNorm over each q and k head before rope."""
    stacked_params_mapping = QKV_GATE_UP_MAPPING
    ignored_weight_substrings = ("rotary_emb.inv_freq",)

    def __init__(
        self, model_config: ModelConfig, quant_config: Optional[QuantizationConfig] = None
    ):
        if model_config.get("use_bidirectional_attention"):
            raise ValueError(
                f"{model_config.architecture} with use_bidirectional_attention is an "
                "embedding model, not a causal LM; cvllm does not serve it"
            )
        super().__init__(model_config, quant_config)

    def _layer_types(self, config: ModelConfig) -> List[str]:
        return gemma_layer_types(config, self.default_sliding_window_pattern)

    def _rotary_embs(self, config: ModelConfig) -> Tuple[RotaryEmbedding, RotaryEmbedding]:
        """``(global, local)`` rope; Gemma 2 uses one for both."""
        rope = self.rotary_embedding(config)
        return rope, rope

    def _attn_softcap(self, config: ModelConfig) -> Optional[float]:
        cap = config.get("attn_logit_softcapping", self.default_attn_logit_softcapping)
        return float(cap) if cap else None

    def layer_plans(self, config: ModelConfig) -> List[LayerPlan]:
        global_rope, local_rope = self._rotary_embs(config)
        # A null sliding_window makes the "sliding" layers global in attention, though
        # they keep the local rope (HF picks rope by layer type, the mask by window).
        window = config.get("sliding_window", self.default_sliding_window)
        return [LayerPlan(local_rope, int(window) if window else None) if kind == SLIDING
                else LayerPlan(global_rope) for kind in self._layer_types(config)]

    def attention_options(self, config: ModelConfig, dtype: torch.dtype) -> GQAOptions:
        # transformers' default for both Gemma 2 and 3 when the config leaves it out.
        scalar = float(config.get("query_pre_attn_scalar", 256))
        qk_norm = (lambda head_dim, heads: self.make_norm(config, dtype, head_dim))
        return GQAOptions(scale=scalar**-0.5, logits_soft_cap=self._attn_softcap(config),
                          qk_norm=qk_norm if self.qk_norm else None)

    def make_mlp(self, config: ModelConfig, layer_idx: int, dtype: torch.dtype,
                 quant_config: Optional[QuantizationConfig], prefix: str) -> GatedMLP:
        # Gemma configs name it hidden_activation; some older ones only hidden_act.
        act = config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh"
        return GatedMLP(config.get("hidden_size"), config.get("intermediate_size"), act, dtype,
                        quant_config, prefix)

    def embed_scale(self, config: ModelConfig, dtype: torch.dtype) -> float:
        # HF rounds sqrt(hidden) to the weights' dtype before scaling (bf16: 8 bits).
        return float(torch.tensor(config.get("hidden_size") ** 0.5, dtype=dtype))

    def logits_soft_cap(self, config: ModelConfig) -> Optional[float]:
        cap = config.get("final_logit_softcapping", self.default_final_logit_softcapping)
        return float(cap) if cap else None

    def cache_specs(self) -> List[LayerCacheSpec]:
        """Per-layer KV cache specs (this rank's KV heads): sliding layers keep only
        their window's blocks."""
        dtype = torch_dtype(self.config.dtype)
        specs: List[LayerCacheSpec] = []
        for layer in self.model.layers:
            attn = layer.self_attn.attn
            if attn.sliding_window:
                specs.append(
                    SlidingWindowSpec(attn.num_kv_heads, attn.head_size, dtype, attn.sliding_window)
                )
            else:
                specs.append(FullAttentionSpec(attn.num_kv_heads, attn.head_size, dtype))
        return specs

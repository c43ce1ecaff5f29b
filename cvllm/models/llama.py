"""Llama-family decoder (LlamaForCausalLM; MistralForCausalLM = Llama + sliding window).

Built by the worker on every rank (``get_model_class(arch)(model_config)``, under the
target ``torch.device`` context), holding this rank's weight shards; it owns no KV cache.
``forward(input_ids, positions, attn_metadata, kv_caches)`` takes the worker's per-layer
``(k_cache, v_cache)`` list explicitly each step, so CUDA-graph capture and several
engines in one process need no binding step. Every setting is read from the config
(DESIGN rule 10): head_dim, rope (type, theta, scaling, partial factor), attention_bias,
mlp_bias, rms_norm_eps, tie_word_embeddings, hidden_act, sliding_window.

Families built on this decoder (qwen2.py, qwen3.py, glm4.py) subclass it through class
hooks instead of copying it: ``LlamaDecoderLayer.attention_cls``,
``LlamaModel.decoder_layer_cls`` / ``rope_is_neox_style``, ``LlamaForCausalLM.model_cls``
and ``_sliding_window`` (one window, or one per layer).
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from cvllm.attention.kv_cache import KVCache
from cvllm.attention.metadata import AttentionMetadata
from cvllm.config import ModelConfig
from cvllm.layers.activation import get_act_and_mul_fn
from cvllm.layers.attention import Attention
from cvllm.layers.embedding import LogitsProcessor, ParallelLMHead, VocabParallelEmbedding
from cvllm.layers.layernorm import RMSNorm
from cvllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from cvllm.layers.rotary import RotaryEmbedding, get_rope, rope_parameters_from_config
from cvllm.layers.utils import torch_dtype
from cvllm.models.base import CausalLMBase
from cvllm.quantization.base import QuantizationConfig


class LlamaMLP(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        quant_config: Optional[QuantizationConfig],
        prefix: str,
    ):
        super().__init__()
        hidden, inter = config.get("hidden_size"), config.get("intermediate_size")
        bias = bool(config.get("mlp_bias", False))
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden,
            [inter, inter],
            bias=bias,
            params_dtype=dtype,
            quant_config=quant_config,
            prefix=f"{prefix}.gate_up_proj",
        )
        self.down_proj = RowParallelLinear(
            inter,
            hidden,
            bias=bias,
            params_dtype=dtype,
            quant_config=quant_config,
            prefix=f"{prefix}.down_proj",
        )
        self.act_fn = get_act_and_mul_fn(config.get("hidden_act", "silu"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # down_proj applies the activation (in its batch-1 GEMV where it can).
        return self.down_proj(self.gate_up_proj(x), act_fn=self.act_fn)  # [T, hidden]


class LlamaAttention(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        rotary_emb: RotaryEmbedding,
        dtype: torch.dtype,
        quant_config: Optional[QuantizationConfig],
        prefix: str,
        sliding_window: Optional[int],
        qkv_bias: Optional[bool] = None,
        o_bias: Optional[bool] = None,
    ):
        """``qkv_bias`` / ``o_bias`` default to the config's ``attention_bias``; families
        that fix them regardless of config (Qwen2: q/k/v only) pass them."""
        super().__init__()
        hidden = config.get("hidden_size")
        self.head_dim = config.head_dim
        bias = bool(config.get("attention_bias", False))
        qkv_bias = bias if qkv_bias is None else qkv_bias
        o_bias = bias if o_bias is None else o_bias
        self.qkv_proj = QKVParallelLinear(
            hidden,
            self.head_dim,
            config.num_heads,
            config.num_kv_heads,
            bias=qkv_bias,
            params_dtype=dtype,
            quant_config=quant_config,
            prefix=f"{prefix}.qkv_proj",
        )
        # This rank's heads: the parallel layer owns the split (and any KV replication).
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = (
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
        )
        self.o_proj = RowParallelLinear(
            config.num_heads * self.head_dim,
            hidden,
            bias=o_bias,
            params_dtype=dtype,
            quant_config=quant_config,
            prefix=f"{prefix}.o_proj",
            input_blocks=self.qkv_proj.o_proj_input_blocks,  # uneven head split: padded
            block_size=self.head_dim,
        )
        self.rotary_emb = rotary_emb
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            self.head_dim**-0.5,
            self.num_kv_heads,
            sliding_window=sliding_window,
            prefix=f"{prefix}.attn",
            backend=config.attention_backend,
        )

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        kv_cache: KVCache,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)  # [T, (H + 2*Hkv) * D]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        # The backend rotates q and k (in place) together with its K/V cache write.
        out = self.attn(q, k, v, kv_cache, attn_metadata, positions, self.rotary_emb)  # [T, H*D]
        return self.o_proj(out)  # [T, hidden]

    flat_forward = forward
    """The forward ``models/flat_decode.py`` reproduces for this class: qkv, the per-head
    q / k maps of ``qk_maps`` (none here), rotation, attention, o_proj. A subclass that
    overrides ``forward`` otherwise keeps this one, so its layers stay on their forward."""

    def qk_maps(self) -> Tuple[Optional[Callable], Optional[Callable]]:
        """What ``forward`` does to q and k (``[T, heads * D]`` each) before the rotation:
        ``(None, None)`` for nothing."""
        return None, None


class LlamaDecoderLayer(nn.Module):
    # Families that differ only in attention (Qwen2 biases, Qwen3 q/k norms) swap this.
    attention_cls = LlamaAttention
    # o_proj and down_proj return partial sums; the RMSNorm after each sums them over
    # the TP group (one kernel with the add and norm where comm can). A subclass whose
    # forward or norms differ sets this False and keeps the reduction in the linears.
    reduce_in_norm = True
    defer_reduce = False  # this layer's choice (reduce_in_norm, and more than one rank)

    def __init__(
        self,
        config: ModelConfig,
        rotary_emb: RotaryEmbedding,
        dtype: torch.dtype,
        quant_config: Optional[QuantizationConfig],
        prefix: str,
        sliding_window: Optional[int],
    ):
        super().__init__()
        hidden, eps = config.get("hidden_size"), float(config.get("rms_norm_eps", 1e-6))
        self.self_attn = self.attention_cls(
            config, rotary_emb, dtype, quant_config, f"{prefix}.self_attn", sliding_window
        )
        self.mlp = LlamaMLP(config, dtype, quant_config, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(hidden, eps, dtype)
        self.post_attention_layernorm = RMSNorm(hidden, eps, dtype)
        if self.reduce_in_norm and self.self_attn.o_proj.tp_size > 1:
            self.defer_reduce = True
            for linear in (self.self_attn.o_proj, self.mlp.down_proj):
                linear.reduce_results = False
                linear.push_partial = True  # its GEMV may push for the norm's reduction

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: Optional[torch.Tensor],
        kv_cache: KVCache,
        attn_metadata: AttentionMetadata,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(delta, residual)``; the next norm adds them (``delta`` is this
        rank's partial sum when ``defer_reduce``)."""
        if residual is None:  # the embedding's output: already whole
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual,
                                                           reduce=self.defer_reduce)
        hidden_states = self.self_attn(positions, hidden_states, kv_cache, attn_metadata)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual,
                                                                reduce=self.defer_reduce)
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):
    decoder_layer_cls = LlamaDecoderLayer
    # False: GPT-J rope rotating interleaved pairs (GLM-4), not rotate-half.
    rope_is_neox_style = True

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        quant_config: Optional[QuantizationConfig],
        sliding_window: Union[None, int, Sequence[Optional[int]]] = None,
        prefix: str = "model",
    ):
        """``sliding_window``: one window for every layer, or one per layer (None = full)."""
        super().__init__()
        hidden = config.get("hidden_size")
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, hidden, dtype, prefix=f"{prefix}.embed_tokens",
            quant_config=quant_config
        )
        rotary_emb = get_rope(
            config.head_dim,
            config.max_model_len,
            rope_parameters_from_config(config.hf_config),
            config.native_max_len,
            is_neox_style=self.rope_is_neox_style,
        )
        windows = (
            list(sliding_window)
            if isinstance(sliding_window, (list, tuple))
            else [sliding_window] * config.num_layers
        )
        if len(windows) != config.num_layers:
            raise ValueError(f"{len(windows)} sliding windows for {config.num_layers} layers")
        self.layers = nn.ModuleList(
            self.decoder_layer_cls(
                config, rotary_emb, dtype, quant_config, f"{prefix}.layers.{i}", windows[i]
            )
            for i in range(config.num_layers)
        )
        self.norm = RMSNorm(hidden, float(config.get("rms_norm_eps", 1e-6)), dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
        kv_caches: Sequence[KVCache],
    ) -> torch.Tensor:
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"got {len(kv_caches)} KV caches for {len(self.layers)} layers")
        hidden_states = self.embed_tokens(input_ids)  # [T, hidden]
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden_states, residual = layer(
                positions, hidden_states, residual, kv_cache, attn_metadata
            )
        if self.layers[-1].defer_reduce:  # the last MLP's partial sum
            hidden_states, _ = self.norm(hidden_states, residual, reduce=True)
        else:
            hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(CausalLMBase):
    model_cls = LlamaModel
    # tp need not divide the attention heads (balanced uneven split; the builder asks).
    uneven_tp_heads = True
    # HF checkpoint parts fused into one parameter here: (param part, checkpoint part, shard_id)
    stacked_params_mapping = [
        (".qkv_proj", ".q_proj", "q"),
        (".qkv_proj", ".k_proj", "k"),
        (".qkv_proj", ".v_proj", "v"),
        (".gate_up_proj", ".gate_proj", 0),
        (".gate_up_proj", ".up_proj", 1),
    ]
    # Non-weights some checkpoints carry.
    ignored_weight_substrings = (
        "rotary_emb.inv_freq",
        "rotary_emb.cos_cached",
        "rotary_emb.sin_cached",
    )

    def __init__(
        self, model_config: ModelConfig, quant_config: Optional[QuantizationConfig] = None
    ):
        super().__init__()
        self.config = model_config
        dtype = torch_dtype(model_config.dtype)
        self.model = self.model_cls(
            model_config, dtype, quant_config, self._sliding_window(model_config)
        )
        hidden = model_config.get("hidden_size")
        self.tie_word_embeddings = bool(model_config.get("tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(
            model_config.vocab_size, hidden, params_dtype=dtype, prefix="lm_head",
            quant_config=quant_config
        )
        if self.tie_word_embeddings:
            self.lm_head.tie_weights(self.model.embed_tokens)
        self.logits_processor = LogitsProcessor(model_config.vocab_size)

    @staticmethod
    def _sliding_window(model_config: ModelConfig) -> Union[None, int, List[Optional[int]]]:
        """One window for all layers, or one per layer (None = full attention)."""
        return None


class MistralForCausalLM(LlamaForCausalLM):
    """Llama with an optional ``sliding_window`` over the attention context."""

    @staticmethod
    def _sliding_window(model_config: ModelConfig) -> Optional[int]:
        window = model_config.get("sliding_window")
        return int(window) if window else None

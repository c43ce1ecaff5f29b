"""StableLM decoder (StableLmForCausalLM: StableLM-3B-4E1T, StableLM-2, StableCode).

Llama's decoder (``llama.py``) with, as in transformers' ``StableLmDecoderLayer``:
LayerNorms with bias instead of RMSNorm (``layer_norm_eps``); q/k/v bias only when
``use_qkv_bias``, never on o_proj; rope on the first ``partial_rotary_factor`` of each
head; with ``qk_layernorm`` a bias-free LayerNorm per head with its own weight on q and
on k, before rope; with ``use_parallel_residual`` attention and MLP read the same input
norm, ``out = x + attn(ln(x)) + mlp(ln(x))`` (no post_attention_layernorm), otherwise the
usual sequential residual. Built by the worker on every rank like every model class.

The per-head norms arrive one tensor per head in HF checkpoints
(``q_layernorm.norms.{h}.weight``) and stacked ``[heads, head_dim]`` in GGUF files
(llama.cpp's converter stacks them); ``load_weights`` stacks the HF ones, and the
parameter's weight_loader (``layers/layernorm.PerHeadLayerNorm``) keeps this rank's heads.
"""

from __future__ import annotations

import re
from typing import Dict, Iterable, Iterator, Optional, Set, Tuple

import torch

from cvllm.attention.kv_cache import KVCache
from cvllm.attention.metadata import AttentionMetadata
from cvllm.config import ModelConfig
from cvllm.layers.layernorm import LayerNorm, PerHeadLayerNorm
from cvllm.layers.utils import as_tensor
from cvllm.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from cvllm.models.phi import reset_layernorms_


class StableLmAttention(LlamaAttention):
    def __init__(self, config, rotary_emb, dtype, quant_config, prefix, sliding_window):
        super().__init__(
            config, rotary_emb, dtype, quant_config, prefix, sliding_window,
            qkv_bias=bool(config.get("use_qkv_bias", False)), o_bias=False,
        )
        if config.get("qk_layernorm", False):
            eps, qkv = float(config.get("layer_norm_eps", 1e-5)), self.qkv_proj
            self.q_layernorm = PerHeadLayerNorm(qkv.q_head_ids, self.head_dim, eps, dtype)
            self.k_layernorm = PerHeadLayerNorm(qkv.kv_head_ids, self.head_dim, eps, dtype)
        else:
            self.q_layernorm = self.k_layernorm = None

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        kv_cache: KVCache,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)  # [T, (H + 2*Hkv) * D]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_layernorm is not None:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        # The backend rotates q and k (in place) together with its K/V cache write.
        out = self.attn(q, k, v, kv_cache, attn_metadata, positions, self.rotary_emb)  # [T, H*D]
        return self.o_proj(out)  # [T, hidden]


class StableLmDecoderLayer(LlamaDecoderLayer):
    attention_cls = StableLmAttention
    reduce_in_norm = False  # LayerNorms, and the parallel residual adds before any norm

    def __init__(self, config, rotary_emb, dtype, quant_config, prefix, sliding_window):
        super().__init__(config, rotary_emb, dtype, quant_config, prefix, sliding_window)
        hidden, eps = config.get("hidden_size"), float(config.get("layer_norm_eps", 1e-5))
        self.input_layernorm = LayerNorm(hidden, eps, dtype)
        parallel = bool(config.get("use_parallel_residual", False))
        self.post_attention_layernorm = None if parallel else LayerNorm(hidden, eps, dtype)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: Optional[torch.Tensor],
        kv_cache: KVCache,
        attn_metadata: AttentionMetadata,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Llama's contract: returns ``(delta, residual)``; the next norm adds them."""
        if residual is None:
            residual = hidden_states
            h = self.input_layernorm(hidden_states)
        else:
            h, residual = self.input_layernorm(hidden_states, residual)
        attn = self.self_attn(positions, h, kv_cache, attn_metadata)  # [T, hidden]
        if self.post_attention_layernorm is None:  # parallel residual
            return attn + self.mlp(h), residual
        h, residual = self.post_attention_layernorm(attn, residual)
        return self.mlp(h), residual


class StableLmModel(LlamaModel):
    decoder_layer_cls = StableLmDecoderLayer

    def __init__(self, config: ModelConfig, dtype, quant_config, sliding_window=None,
                 prefix: str = "model"):
        super().__init__(config, dtype, quant_config, sliding_window, prefix)
        eps = float(config.get("layer_norm_eps", 1e-5))
        self.norm = LayerNorm(config.get("hidden_size"), eps, dtype)


_PER_HEAD_NORM = re.compile(r"(.*\.[qk]_layernorm)\.norms\.(\d+)\.weight")


def stack_per_head_norms(
    weights: Iterable[Tuple[str, torch.Tensor]], num_heads: int, num_kv_heads: int
) -> Iterator[Tuple[str, torch.Tensor]]:
    """HF's ``*_layernorm.norms.{h}.weight`` tensors as one ``*_layernorm.weight``
    ``[heads, D]`` per layer, yielded once all heads of it have arrived; everything else
    passes through. Incomplete sets pass through under their own names (and then fail
    loading as unknown tensors)."""
    pending: Dict[str, Dict[int, torch.Tensor]] = {}
    for name, tensor in weights:
        m = _PER_HEAD_NORM.fullmatch(name)
        if m is None:
            yield name, tensor
            continue
        stem, head = m.group(1), int(m.group(2))
        heads = pending.setdefault(stem, {})
        heads[head] = as_tensor(tensor)  # one tiny [D] vector per head
        want = num_heads if stem.endswith("q_layernorm") else num_kv_heads
        if sorted(heads) == list(range(want)):
            yield f"{stem}.weight", torch.stack([heads[i] for i in range(want)])  # [H, D]
            del pending[stem]
    for stem, heads in pending.items():
        for head, tensor in heads.items():
            yield f"{stem}.norms.{head}.weight", tensor


class StableLmForCausalLM(LlamaForCausalLM):
    model_cls = StableLmModel

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> Set[str]:
        cfg = self.config
        return super().load_weights(stack_per_head_norms(weights, cfg.num_heads, cfg.num_kv_heads))

    def init_dummy_weights(self, seed: int) -> None:
        super().init_dummy_weights(seed)
        reset_layernorms_(self)
        for module in self.modules():
            if isinstance(module, PerHeadLayerNorm):
                module.weight.data.fill_(1.0)

"""StableLM decoder (StableLmForCausalLM: StableLM-3B-4E1T, StableLM-2, StableCode).

Llama's decoder (``llama.py``) declaring, as in transformers' ``StableLmDecoderLayer``:
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
from typing import Dict, Iterable, Iterator, Tuple

import torch

from cvllm.config import ModelConfig
from cvllm.layers.layernorm import LayerNorm, PerHeadLayerNorm
from cvllm.layers.utils import as_tensor
from cvllm.models.base import LayerPlan
from cvllm.models.blocks import LLAMA_LAYER, GQAOptions, LayerNames
from cvllm.models.llama import LlamaForCausalLM
from cvllm.models.phi import reset_layernorms_


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
    norm_cls = LayerNorm
    norm_eps = ("layer_norm_eps", 1e-5)
    reduce_in_norm = False  # LayerNorms, and the parallel residual adds before any norm

    def names_of(self, config: ModelConfig, plan: LayerPlan) -> LayerNames:
        if config.get("use_parallel_residual"):  # no mlp_norm: the parallel residual
            return LLAMA_LAYER[:3]
        return LLAMA_LAYER

    def attention_options(self, config: ModelConfig, dtype: torch.dtype) -> GQAOptions:
        eps = float(config.get("layer_norm_eps", 1e-5))
        qk_norm = (lambda head_dim, heads: PerHeadLayerNorm(heads, head_dim, eps, dtype))
        return GQAOptions(qkv_bias=bool(config.get("use_qkv_bias", False)), o_bias=False,
                          qk_norm=qk_norm if config.get("qk_layernorm", False) else None,
                          qk_norm_names=("q_layernorm", "k_layernorm"))

    def checkpoint_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> Iterator:
        cfg = self.config
        return stack_per_head_norms(weights, cfg.num_heads, cfg.num_kv_heads)

    def init_dummy_weights(self, seed: int) -> None:
        super().init_dummy_weights(seed)
        reset_layernorms_(self)
        for module in self.modules():
            if isinstance(module, PerHeadLayerNorm):
                module.weight.data.fill_(1.0)

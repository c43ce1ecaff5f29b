"""The causal-LM wrapper every model family shares: a decoder stack (``self.model``), an
LM head with its logits processor, and HF-named weight loading.

Subclasses build ``self.model``, ``self.lm_head``, ``self.logits_processor`` and set
``tie_word_embeddings``, ``stacked_params_mapping`` (HF shard name -> fused parameter) and
``ignored_weight_substrings``; families with extra loading rules override
``load_weights``. Built by the worker on every rank; holds no KV cache.
"""

from __future__ import annotations

from typing import Iterable, Sequence, Set, Tuple

import torch
from torch import nn

from cvllm.attention.metadata import AttentionMetadata
from cvllm.models import utils as model_utils


class CausalLMBase(nn.Module):
    tie_word_embeddings: bool = False
    stacked_params_mapping: Sequence[Tuple[str, str, object]] = ()
    ignored_weight_substrings: Sequence[str] = ()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata, kv_caches: Sequence) -> torch.Tensor:
        """``input_ids [T]``, ``positions [T]`` -> hidden states ``[T, hidden]``; updates
        each layer's cache entry in ``kv_caches`` (K/V, latents or state slots)."""
        return self.model(input_ids, positions, attn_metadata, kv_caches)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[S, hidden] -> [S, vocab]`` float32 (soft-capped where the config says so)."""
        return self.logits_processor(self.lm_head, hidden_states)

    def _skipped_weights(self) -> Tuple[str, ...]:
        return ("lm_head.weight",) if self.tie_word_embeddings else ()

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> Set[str]:
        """Load HF-named tensors (``model.layers.0.self_attn.q_proj.weight``, ...); raises
        ``WeightLoadError`` listing unknown or missing ones."""
        return model_utils.load_weights_with_mapping(
            self, weights, self.stacked_params_mapping, self.ignored_weight_substrings,
            self._skipped_weights(),
        )

    def init_dummy_weights(self, seed: int) -> None:
        model_utils.init_dummy_weights(self, seed)

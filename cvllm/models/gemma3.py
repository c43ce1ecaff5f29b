"""Gemma 3 text decoder: Gemma3ForCausalLM, and the language model of
Gemma3ForConditionalGeneration (its vision tower is not served).

Built by the worker on every rank like every model class. Gemma 2's classes
(``gemma2.py``) with, as in transformers' ``modeling_gemma3``:

- a Gemma RMSNorm over each q and each k head before rope (``q_norm`` / ``k_norm``);
- two ropes: sliding layers use the local base (``rope_local_base_freq``, 10000) with no
  scaling, global layers ``rope_theta`` (1e6) with the config's rope scaling (linear x8
  on the 4B and larger). Read from transformers 5's per-layer-type ``rope_parameters``
  (``{"full_attention": {...}, "sliding_attention": {...}}``) or from the older flat keys;
- every 6th layer global unless ``layer_types`` / ``sliding_window_pattern`` say otherwise;
- no attention softcap: transformers' ``Gemma3Attention`` never hands
  ``attn_logit_softcapping`` to its attention function, so a value in the config has no
  effect there, nor here. ``final_logit_softcapping`` applies when set (default null).

Gemma3ForConditionalGeneration: the loader lifts ``text_config`` to the top level of the
config (``loader/hf_config.py``). Its checkpoints name text weights
``language_model.model.*`` (what ``save_pretrained`` writes, and Google's files) or
``model.language_model.*`` (transformers 5's module names); vision tower and projector
weights are skipped with one log line.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, Iterable, Iterator, Mapping, Optional, Tuple

import torch

from cvllm.config import ModelConfig
from cvllm.layers.rotary import RotaryEmbedding, get_rope, rope_parameters_from_config
from cvllm.models.gemma2 import FULL, SLIDING, Gemma2ForCausalLM

logger = logging.getLogger("cvllm.models")

# transformers' Gemma3TextConfig.default_theta
DEFAULT_GLOBAL_THETA, DEFAULT_LOCAL_THETA = 1_000_000.0, 10_000.0


def gemma3_rope_parameters(cfg: Mapping[str, Any]) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """``(global, local)`` flat rope parameter dicts (``rope_type``, ``rope_theta``, scaling
    keys) for ``get_rope``, from either config spelling."""
    rp = cfg.get("rope_parameters")
    if isinstance(rp, Mapping) and (FULL in rp or SLIDING in rp):
        return (_flat_rope(rp.get(FULL), DEFAULT_GLOBAL_THETA),
                _flat_rope(rp.get(SLIDING), DEFAULT_LOCAL_THETA))
    # Older configs: rope_theta + rope_scaling for global layers, rope_local_base_freq.
    glob = rope_parameters_from_config(
        {**cfg, "rope_theta": cfg.get("rope_theta", DEFAULT_GLOBAL_THETA)}
    )
    local = _flat_rope({"rope_theta": cfg.get("rope_local_base_freq")}, DEFAULT_LOCAL_THETA)
    return glob, local


def _flat_rope(params: Optional[Mapping[str, Any]], default_theta: float) -> Dict[str, Any]:
    out = dict(params or {})
    out["rope_type"] = out.pop("type", None) or out.get("rope_type") or "default"
    if out.get("rope_theta") is None:
        out["rope_theta"] = default_theta
    out.setdefault("partial_rotary_factor", 1.0)
    return out


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    # transformers' Gemma3TextConfig defaults, for keys a config.json leaves out.
    default_sliding_window_pattern = 6
    default_final_logit_softcapping = None
    default_attn_logit_softcapping = None
    qk_norm = True

    def _rotary_embs(self, config: ModelConfig) -> Tuple[RotaryEmbedding, RotaryEmbedding]:
        glob, local = gemma3_rope_parameters(config.hf_config)
        return tuple(
            get_rope(config.head_dim, config.max_model_len, params, config.native_max_len,
                     is_neox_style=True)
            for params in (glob, local)
        )

    def _attn_softcap(self, config: ModelConfig) -> Optional[float]:
        if config.get("attn_logit_softcapping"):
            logger.warning("ignoring attn_logit_softcapping=%s: Gemma 3 does not apply it "
                           "(transformers' Gemma3Attention ignores it too)",
                           config.get("attn_logit_softcapping"))
        return None


# Checkpoint prefix -> this model's name for the text weights of a multimodal Gemma 3.
_TEXT_PREFIXES = (
    ("language_model.model.", "model."),
    ("model.language_model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)
_VISION_PREFIXES = (
    "vision_tower.", "multi_modal_projector.",
    "model.vision_tower.", "model.multi_modal_projector.",
)


def gemma3_text_weights(
    weights: Iterable[Tuple[str, torch.Tensor]],
) -> Iterator[Tuple[str, torch.Tensor]]:
    """A Gemma3ForConditionalGeneration checkpoint's text weights under
    Gemma3ForCausalLM names; vision weights dropped (logged once, at the end)."""
    skipped = 0
    for name, tensor in weights:
        if name.startswith(_VISION_PREFIXES):
            skipped += 1
            continue
        for old, new in _TEXT_PREFIXES:
            if name.startswith(old):
                name = new + name[len(old):]
                break
        yield name, tensor
    if skipped:
        logger.info("skipped %d vision tower / projector tensors: cvllm serves the text "
                    "model of Gemma3ForConditionalGeneration only", skipped)


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """The language model of a multimodal Gemma 3 checkpoint; text-only prompts."""

    def checkpoint_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> Iterator:
        return gemma3_text_weights(weights)

"""gemma2: llama.cpp's converter writes Gemma norms with their +1 folded in, skips the
tied lm_head, names the four per-layer norms attn_norm / post_attention_norm / ffn_norm
(pre-feedforward) / post_ffw_norm, and stores head_dim as key/value length, the two
softcaps and the sliding window. It writes no rope base (llama.cpp defaults to 10000),
no sliding pattern (implied: every 2nd layer global) and no query_pre_attn_scalar (implied:
head_dim, except on the 27B)."""

from pathlib import Path
from typing import Any, Dict, Optional

import numpy as np

from .common import (COMMON_LAYER_NAMES, QuantPlan, base_kv, gguf_tensor_name, state_tensors,
                     write_gguf)

GEMMA_LAYER_NAMES = {
    **COMMON_LAYER_NAMES,
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def gemma_name(hf_name: str) -> str:
    return gguf_tensor_name(hf_name, GEMMA_LAYER_NAMES)


def gemma_norm_plus_one(name: str, arr: np.ndarray) -> np.ndarray:
    """HF's Gemma RMSNorm scales by (1 + weight); llama.cpp's by weight."""
    return arr + 1.0 if name.endswith("norm.weight") else arr


def gemma_kv(arch: str, cfg: Any) -> Dict[str, Any]:
    """Keys both Gemma converters write."""
    p = arch + "."
    kv = base_kv(arch, cfg)
    kv.pop(p + "rope.freq_base", None)
    kv[p + "attention.layer_norm_rms_epsilon"] = float(cfg.rms_norm_eps)
    kv[p + "attention.key_length"] = int(cfg.head_dim)
    kv[p + "attention.value_length"] = int(cfg.head_dim)
    kv[p + "attention.sliding_window"] = int(cfg.sliding_window)
    kv[p + "vocab_size"] = int(cfg.vocab_size)
    kv["tokenizer.ggml.bos_token_id"] = int(cfg.bos_token_id)
    kv["tokenizer.ggml.eos_token_id"] = int(cfg.eos_token_id)
    return kv


def export(model, path: Path, plan: Optional[QuantPlan] = None) -> Path:
    cfg = model.config
    kv = gemma_kv("gemma2", cfg)
    kv["gemma2.attn_logit_softcapping"] = float(cfg.attn_logit_softcapping)
    kv["gemma2.final_logit_softcapping"] = float(cfg.final_logit_softcapping)
    tensors = state_tensors(model, gemma_name, gemma_norm_plus_one)
    return write_gguf(path, "gemma2", kv, tensors, plan)

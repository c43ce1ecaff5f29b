"""phi3: what llama.cpp's converter writes for Phi-3/3.5/4. Rope is NEOX (rotate-half),
so no Q/K permutation; q/k/v stay fused as ``attn_qkv`` and gate/up as ``ffn_up`` (gate
rows first); ``rope.dimension_count`` is ``int(partial * hidden) // heads``; the original
context length is always written (``rope.scaling.original_context_length``) and the sliding
window as ``attention.sliding_window`` (0 when the config has none). LongRoPE is written
without a ``rope.scaling.type``: the factor lists as the ``rope_factors_long`` /
``rope_factors_short`` tensors, plus ``rope.scaling.attn_factor`` =
sqrt(1 + ln(max_pos / original) / ln(original)) (1 when not extending)."""

import math
from pathlib import Path
from typing import Optional

import numpy as np

from .common import (COMMON_LAYER_NAMES, QuantPlan, base_kv, gguf_tensor_name, state_tensors,
                     write_gguf)
from .phi2 import partial_rotary_factor

PHI3_LAYER_NAMES = {**COMMON_LAYER_NAMES, "self_attn.qkv_proj": "attn_qkv",
                    "mlp.gate_up_proj": "ffn_up"}


def export(model, path: Path, plan: Optional[QuantPlan] = None) -> Path:
    cfg = model.config
    kv = base_kv("phi3", cfg)
    kv["phi3.vocab_size"] = int(cfg.vocab_size)
    kv["phi3.attention.layer_norm_rms_epsilon"] = float(cfg.rms_norm_eps)
    kv["phi3.rope.dimension_count"] = (
        int(partial_rotary_factor(cfg) * cfg.hidden_size) // cfg.num_attention_heads
    )
    original = int(cfg.original_max_position_embeddings)
    kv["phi3.rope.scaling.original_context_length"] = original
    kv["phi3.attention.sliding_window"] = int(cfg.sliding_window or 0)
    if cfg.pad_token_id is not None:
        kv["tokenizer.ggml.padding_token_id"] = int(cfg.pad_token_id)
    tensors = state_tensors(model, lambda n: gguf_tensor_name(n, PHI3_LAYER_NAMES))
    rope = cfg.rope_parameters
    if rope.get("rope_type") in ("longrope", "su"):
        scale = cfg.max_position_embeddings / original
        attn_factor = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
        kv["phi3.rope.scaling.attn_factor"] = float(attn_factor)
        tensors["rope_factors_long.weight"] = np.asarray(rope["long_factor"], dtype=np.float32)
        tensors["rope_factors_short.weight"] = np.asarray(rope["short_factor"], dtype=np.float32)
    return write_gguf(path, "phi3", kv, tensors, plan)

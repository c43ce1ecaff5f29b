"""stablelm: what llama.cpp's converter writes for StableLM. Rope is NEOX (rotate-half),
so no Q/K permutation; ``rope.dimension_count`` is ``int(partial * head_dim)``;
``use_parallel_residual`` is a bool key (and parallel layers have no ``ffn_norm``); the
LayerNorms carry biases; q/k/v biases appear only with ``use_qkv_bias``; the per-head q/k
LayerNorm weights (``q_layernorm.norms.{h}.weight``) are stacked into one
``attn_q_norm`` / ``attn_k_norm`` tensor ``[heads, head_dim]`` per layer. No
rope.freq_base in the converter's files (llama.cpp's default 10000 applies); this writer
adds it only when the config's theta differs."""

from pathlib import Path
from typing import Optional

import numpy as np

from .common import (COMMON_LAYER_NAMES, QuantPlan, base_kv, gguf_tensor_name, state_tensors,
                     write_gguf)
from .phi2 import partial_rotary_factor


def _name(hf_name: str):
    if ".norms." in hf_name:  # per-head norms: stacked below
        return None
    return gguf_tensor_name(hf_name, COMMON_LAYER_NAMES)


def export(model, path: Path, plan: Optional[QuantPlan] = None) -> Path:
    cfg = model.config
    kv = base_kv("stablelm", cfg)
    kv["stablelm.vocab_size"] = int(cfg.vocab_size)
    rope = getattr(cfg, "rope_parameters", None) or {}
    if float(rope.get("rope_theta", 10000.0)) == 10000.0:
        kv.pop("stablelm.rope.freq_base", None)
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    kv["stablelm.rope.dimension_count"] = int(partial_rotary_factor(cfg) * head_dim)
    kv["stablelm.use_parallel_residual"] = bool(cfg.use_parallel_residual)
    kv["stablelm.attention.layer_norm_epsilon"] = float(cfg.layer_norm_eps)
    tensors = state_tensors(model, _name)
    if cfg.qk_layernorm:
        sd = model.state_dict()
        heads = {"q": cfg.num_attention_heads, "k": cfg.num_key_value_heads}
        for i in range(cfg.num_hidden_layers):
            for x, n in heads.items():
                stem = f"model.layers.{i}.self_attn.{x}_layernorm.norms"
                rows = [sd[f"{stem}.{h}.weight"].float().numpy() for h in range(n)]
                tensors[f"blk.{i}.attn_{x}_norm.weight"] = np.stack(rows)  # [heads, head_dim]
    return write_gguf(path, "stablelm", kv, tensors, plan)

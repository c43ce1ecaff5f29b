"""phi2: what llama.cpp's converter writes for Phi-2. Rope is NEOX (rotate-half, as HF's),
so Q/K rows stay unpermuted; ``rope.dimension_count`` is ``int(partial * hidden) // heads``;
LayerNorms carry biases (``attn_norm``, ``output_norm``), and so do ``output``, the fused
``attn_qkv`` (q, k, v rows stacked, as in the published Phi-2 files converted from the
original ``Wqkv``; ``fused_qkv=False`` writes attn_q/k/v as converters of HF-format
checkpoints do), ``attn_output`` (HF ``dense``), ``ffn_up`` (``fc1``), ``ffn_down``
(``fc2``). No rope.freq_base in the converter's files (llama.cpp's default 10000 applies);
this writer adds it only when the config's theta differs. The converter writes
``head_count_kv = head_count`` (Phi-2 is MHA); here it is the config's value."""

from pathlib import Path
from typing import Optional

import numpy as np

from .common import QuantPlan, base_kv, gguf_tensor_name, state_tensors, write_gguf

PHI2_LAYER_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.dense": "attn_output", "input_layernorm": "attn_norm",
    "mlp.fc1": "ffn_up", "mlp.fc2": "ffn_down",
}
PHI2_TOP_NAMES = {"model.embed_tokens": "token_embd", "model.final_layernorm": "output_norm",
                  "lm_head": "output"}


def partial_rotary_factor(cfg) -> float:
    rope = getattr(cfg, "rope_parameters", None) or {}
    return float(rope.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0)))


def fuse_qkv(tensors, num_layers: int):
    """Replace each layer's attn_q/k/v (weight and bias) by one attn_qkv, rows q|k|v."""
    for i in range(num_layers):
        for suffix in ("weight", "bias"):
            parts = [tensors.pop(f"blk.{i}.attn_{x}.{suffix}", None) for x in "qkv"]
            if all(p is not None for p in parts):
                tensors[f"blk.{i}.attn_qkv.{suffix}"] = np.concatenate(parts, axis=0)
    return tensors


def export(model, path: Path, fused_qkv: bool = True, plan: Optional[QuantPlan] = None) -> Path:
    cfg = model.config
    kv = base_kv("phi2", cfg)
    kv["phi2.vocab_size"] = int(cfg.vocab_size)
    rope = getattr(cfg, "rope_parameters", None) or {}
    if float(rope.get("rope_theta", 10000.0)) == 10000.0:
        kv.pop("phi2.rope.freq_base", None)
    kv["phi2.attention.layer_norm_epsilon"] = float(cfg.layer_norm_eps)
    kv["phi2.rope.dimension_count"] = (
        int(partial_rotary_factor(cfg) * cfg.hidden_size) // cfg.num_attention_heads
    )
    kv["tokenizer.ggml.add_bos_token"] = False
    tensors = state_tensors(model, lambda n: gguf_tensor_name(n, PHI2_LAYER_NAMES, PHI2_TOP_NAMES))
    if fused_qkv:
        tensors = fuse_qkv(tensors, cfg.num_hidden_layers)
    return write_gguf(path, "phi2", kv, tensors, plan)

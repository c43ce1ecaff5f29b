"""llama: Q/K rows interleaved by llama.cpp's permute; head_dim from rope dimension."""

from pathlib import Path
from typing import Optional

from .common import (QuantPlan, base_kv, gguf_tensor_name, llama_cpp_permute, state_tensors,
                     write_gguf)


def export(model, path: Path, plan: Optional[QuantPlan] = None) -> Path:
    cfg = model.config
    kv = base_kv("llama", cfg)
    kv["llama.attention.layer_norm_rms_epsilon"] = float(cfg.rms_norm_eps)
    kv["llama.rope.dimension_count"] = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    kv["llama.vocab_size"] = int(cfg.vocab_size)

    def transform(name, arr):
        if ".q_proj." in name:
            return llama_cpp_permute(arr, cfg.num_attention_heads)
        if ".k_proj." in name:
            return llama_cpp_permute(arr, cfg.num_key_value_heads)
        return arr

    return write_gguf(path, "llama", kv, state_tensors(model, gguf_tensor_name, transform), plan)

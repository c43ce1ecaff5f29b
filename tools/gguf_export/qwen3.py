"""qwen3: like qwen2 (NEOX rope, no Q/K permutation) plus the per-head ``attn_q_norm`` /
``attn_k_norm`` and ``attention.key_length`` for Qwen3's explicit head_dim."""

from pathlib import Path
from typing import Optional

from .common import QuantPlan, gguf_tensor_name, state_tensors, write_gguf
from .qwen2 import qwen_kv


def export(model, path: Path, plan: Optional[QuantPlan] = None) -> Path:
    return write_gguf(path, "qwen3", qwen_kv("qwen3", model.config),
                      state_tensors(model, gguf_tensor_name), plan)

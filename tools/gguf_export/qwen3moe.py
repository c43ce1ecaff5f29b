"""qwen3moe: the qwen2moe conventions (llama.cpp's Qwen3MoeModel subclasses its
Qwen2MoeModel converter) plus the q/k norms ``attn_q_norm`` / ``attn_k_norm`` and
``attention.key_length`` from the config's head_dim; no shared expert."""

from pathlib import Path
from typing import Optional

from . import qwen2moe
from .common import QuantPlan


def export(model, path: Path, plan: Optional[QuantPlan] = None) -> Path:
    return qwen2moe.export(model, path, arch="qwen3moe", plan=plan)

"""glm4: llama.cpp runs GLM-4 with NORM (interleaved-pair) rope, as HF does, so Q/K rows
stay unpermuted; ``rope.dimension_count`` is the partial rotary width
(head_dim * partial_rotary_factor); the extra norms are ``post_attention_norm`` (HF
post_self_attn_layernorm) and ``post_ffw_norm`` (post_mlp_layernorm), and the fused
``gate_up_proj`` is written whole as ``ffn_up``."""

from pathlib import Path
from typing import Optional

from .common import COMMON_LAYER_NAMES, QuantPlan, gguf_tensor_name, state_tensors, write_gguf
from .qwen2 import qwen_kv

GLM4_LAYER_NAMES = {
    **COMMON_LAYER_NAMES,
    "post_self_attn_layernorm": "post_attention_norm",
    "post_mlp_layernorm": "post_ffw_norm",
    "mlp.gate_up_proj": "ffn_up",
}


def export(model, path: Path, plan: Optional[QuantPlan] = None) -> Path:
    cfg = model.config
    kv = qwen_kv("glm4", cfg)  # the same base keys (key_length: GLM-4 configs name head_dim)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    rope = getattr(cfg, "rope_parameters", None) or {}
    factor = rope.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 0.5))
    kv["glm4.rope.dimension_count"] = int(head_dim * factor)
    tensors = state_tensors(model, lambda n: gguf_tensor_name(n, GLM4_LAYER_NAMES))
    return write_gguf(path, "glm4", kv, tensors, plan)

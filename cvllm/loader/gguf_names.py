"""How llama.cpp architectures and tensor names map onto Hugging Face ones.

One ``GGUFArch`` per supported ``general.architecture``; adding an architecture is adding a
row here (plus any tensor-name overrides) and, if its converter rewrites tensors, a
transform in ``gguf_loader``. Names follow llama.cpp's gguf-py ``TensorNameMap``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional

import torch

from .errors import ModelLoadError


@dataclass(frozen=True)
class GGUFArch:
    """How one llama.cpp architecture maps onto a Hugging Face one."""

    hf_architecture: str
    """Class name for config.json ``architectures``, e.g. ``LlamaForCausalLM``."""
    model_type: str
    """HF ``model_type``."""
    permute_qk: bool = False
    """llama.cpp's converter interleaves the Q/K rows of this arch for its rope kernel;
    the loader must undo it to get HF's rotate-half order."""
    head_dim_from_rope: bool = False
    """``rope.dimension_count`` equals head_dim (true for llama, not for partial-rotary archs)."""
    fixed_config: Mapping[str, Any] = field(default_factory=dict)
    """HF config values the GGUF does not store but the architecture implies."""
    layer_tensors: Mapping[str, str] = field(default_factory=dict)
    """Per-arch additions/overrides to ``LAYER_TENSORS``."""


GGUF_ARCHES: Dict[str, GGUFArch] = {
    "llama": GGUFArch("LlamaForCausalLM", "llama", permute_qk=True, head_dim_from_rope=True,
                      fixed_config={"hidden_act": "silu"}),
    "qwen2": GGUFArch("Qwen2ForCausalLM", "qwen2", fixed_config={"hidden_act": "silu"}),
    "qwen3": GGUFArch("Qwen3ForCausalLM", "qwen3", fixed_config={"hidden_act": "silu"}),
}

TOP_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Tensors the HF model has no parameter for; their content is folded into the config
# (rope_freqs -> rope_scaling, see gguf_config).
IGNORED_TENSORS = frozenset({"rope_freqs.weight"})

_LAYER_RE = re.compile(r"blk\.(\d+)\.([a-z0-9_]+)\.(weight|bias)")
_TOP_RE = re.compile(r"([a-z0-9_]+)\.(weight|bias)")


def get_arch(name: str) -> GGUFArch:
    arch = GGUF_ARCHES.get(name)
    if arch is None:
        raise ModelLoadError(f"GGUF architecture {name!r} is not supported; supported: "
                             f"{', '.join(sorted(GGUF_ARCHES))}")
    return arch


def hf_tensor_name(gguf_name: str, arch: GGUFArch) -> Optional[str]:
    """HF parameter name of a GGUF tensor; None for tensors with no HF parameter.

    Raises ModelLoadError for names it does not know, rather than dropping weights silently.
    """
    if gguf_name in IGNORED_TENSORS:
        return None
    m = _LAYER_RE.fullmatch(gguf_name)
    if m:
        layer, part, suffix = m.groups()
        hf = arch.layer_tensors.get(part) or LAYER_TENSORS.get(part)
        if hf is not None:
            return f"model.layers.{int(layer)}.{hf}.{suffix}"
    else:
        m = _TOP_RE.fullmatch(gguf_name)
        if m and m.group(1) in TOP_TENSORS:
            return f"{TOP_TENSORS[m.group(1)]}.{m.group(2)}"
    raise ModelLoadError(f"GGUF tensor {gguf_name!r} has no known Hugging Face name for "
                         f"architecture {arch.model_type!r}")


def unpermute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation.

    The converter regroups each head's rows from HF's [first half | second half] of the
    rotary pairs into interleaved (x0, x_half, x1, x_half+1, ...) order. Per head it does
    ``reshape(2, D/2).T``; the inverse is ``reshape(D/2, 2).T``.
    """
    rows = w.shape[0]
    if rows % (2 * n_heads):
        raise ModelLoadError(f"cannot un-permute a Q/K tensor of {rows} rows over {n_heads} heads")
    rest = tuple(w.shape[1:])
    # [H, D/2, 2, ...] -> [H, 2, D/2, ...]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *rest).transpose(1, 2).reshape(w.shape)

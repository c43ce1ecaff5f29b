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
    top_tensors: Mapping[str, str] = field(default_factory=dict)
    """Per-arch overrides of ``TOP_TENSORS`` (Phi-2's final norm is ``final_layernorm``)."""
    norm_weight_offset: float = 0.0
    """llama.cpp's converter adds this to every ``*norm.weight`` (Gemma: 1, folding the
    ``1 + weight`` of Gemma's RMSNorm into the file); the loader subtracts it again."""


# Gemma's four norms per layer: llama.cpp's ffn_norm is the pre-feedforward one there.
_GEMMA_NORMS = {"post_attention_norm": "post_attention_layernorm",
                "ffn_norm": "pre_feedforward_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm"}

# MoE layers (Qwen2/3-MoE): the router, all experts stacked in one tensor per projection
# ([E, out, in], loaded by FusedMoE.load_stacked), the shared expert and its sigmoid gate.
MOE_LAYER_TENSORS = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}

# GLM-4: norms on the attention and MLP outputs; ffn_up holds the fused gate_up_proj
# (gate rows first, llama.cpp splits it in halves for its SwiGLU).
_GLM4_TENSORS = {"post_attention_norm": "post_self_attn_layernorm",
                 "post_ffw_norm": "post_mlp_layernorm",
                 "ffn_up": "mlp.gate_up_proj"}

# DeepSeek V2/V3 (llama.cpp ``deepseek2``): MLA projections; ``kv_b_proj`` either whole
# (``attn_kv_b``, older converters) or split as current converters write it, ``attn_k_b``
# ``[H, R, Dn]`` (transposed) + ``attn_v_b`` ``[H, Dv, R]``, which ``layers/mla.py``'s
# kv_b loader reassembles; ``exp_probs_b.bias`` is the e_score_correction_bias (the model
# accepts the ``e_score_correction.bias`` spelling); plural ``shared_experts``.
_DEEPSEEK2_TENSORS = {
    **MOE_LAYER_TENSORS,
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
    "attn_k_b": "self_attn.k_b_proj",
    "attn_v_b": "self_attn.v_b_proj",
    "exp_probs_b": "mlp.gate.e_score_correction",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}

# Phi-2: HF's names for the output projection and the MLP; attn_qkv (fused, the published
# files) or attn_q/k/v (newer converters) both load, through QKVParallelLinear.
_PHI2_TENSORS = {"attn_qkv": "self_attn.qkv_proj", "attn_output": "self_attn.dense",
                 "ffn_up": "mlp.fc1", "ffn_down": "mlp.fc2"}
# Phi-3: q/k/v fused, and ffn_up holds the fused gate_up_proj (gate rows first).
_PHI3_TENSORS = {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
# StableLM: the per-head q/k LayerNorms, stacked [heads, head_dim] by the converter.
_STABLELM_TENSORS = {"attn_q_norm": "self_attn.q_layernorm",
                     "attn_k_norm": "self_attn.k_layernorm"}

GGUF_ARCHES: Dict[str, GGUFArch] = {
    "llama": GGUFArch("LlamaForCausalLM", "llama", permute_qk=True, head_dim_from_rope=True,
                      fixed_config={"hidden_act": "silu"}),
    "qwen2": GGUFArch("Qwen2ForCausalLM", "qwen2", fixed_config={"hidden_act": "silu"}),
    "qwen3": GGUFArch("Qwen3ForCausalLM", "qwen3", fixed_config={"hidden_act": "silu"}),
    # GLM-4 rope is llama.cpp's NORM (interleaved pairs, as HF's): no Q/K permutation;
    # rope.dimension_count is the partial rotary width (gguf_config).
    "glm4": GGUFArch("Glm4ForCausalLM", "glm4", fixed_config={"hidden_act": "silu"},
                     layer_tensors=_GLM4_TENSORS),
    # llama.cpp's qwen2moe graph never renormalises the top-k weights; qwen3moe always does.
    "qwen2moe": GGUFArch("Qwen2MoeForCausalLM", "qwen2_moe", layer_tensors=MOE_LAYER_TENSORS,
                         fixed_config={"hidden_act": "silu", "norm_topk_prob": False}),
    "qwen3moe": GGUFArch("Qwen3MoeForCausalLM", "qwen3_moe", layer_tensors=MOE_LAYER_TENSORS,
                         fixed_config={"hidden_act": "silu", "norm_topk_prob": True}),
    # Gemma 2/3: four norms per layer; sliding pattern, softcaps, attention scale: gguf_config.
    # DeepSeek V2 and V3 share llama.cpp's deepseek2; gguf_config picks V3 for sigmoid
    # gating and reads the MLA / routing sizes. Its rope is NORM (interleaved pairs), as
    # DeepSeek's own: no Q/K permutation.
    "deepseek2": GGUFArch("DeepseekV2ForCausalLM", "deepseek_v2", layer_tensors=_DEEPSEEK2_TENSORS,
                          fixed_config={"hidden_act": "silu"}),
    # Phi-2/3 and StableLM rope is llama.cpp's NEOX (rotate-half, as HF's): no Q/K
    # permutation; rope.dimension_count is the partial rotary width (gguf_config).
    "phi2": GGUFArch("PhiForCausalLM", "phi", fixed_config={"hidden_act": "gelu_new"},
                     layer_tensors=_PHI2_TENSORS,
                     top_tensors={"output_norm": "model.final_layernorm"}),
    "phi3": GGUFArch("Phi3ForCausalLM", "phi3", fixed_config={"hidden_act": "silu"},
                     layer_tensors=_PHI3_TENSORS),
    "stablelm": GGUFArch("StableLmForCausalLM", "stablelm", fixed_config={"hidden_act": "silu"},
                         layer_tensors=_STABLELM_TENSORS),
    "gemma2": GGUFArch("Gemma2ForCausalLM", "gemma2", norm_weight_offset=1.0,
                       fixed_config={"hidden_activation": "gelu_pytorch_tanh"},
                       layer_tensors=_GEMMA_NORMS),
    "gemma3": GGUFArch("Gemma3ForCausalLM", "gemma3_text", norm_weight_offset=1.0,
                       fixed_config={"hidden_activation": "gelu_pytorch_tanh"},
                       layer_tensors=_GEMMA_NORMS),
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
# (rope_freqs -> llama3 rope_scaling, rope_factors_* -> longrope; see gguf_config).
IGNORED_TENSORS = frozenset({"rope_freqs.weight", "rope_factors_long.weight",
                             "rope_factors_short.weight"})

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
        hf = m and (arch.top_tensors.get(m.group(1)) or TOP_TENSORS.get(m.group(1)))
        if hf:
            return f"{hf}.{m.group(2)}"
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

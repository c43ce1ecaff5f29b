"""deepseek2 (DeepSeek V2 and V3): llama.cpp's DeepseekV2Model converter conventions.

Metadata: ``head_count_kv`` 1 with ``key_length`` = kv_lora_rank + qk_rope_head_dim and
``value_length`` = kv_lora_rank (the converter views MLA as MQA over the latent), the
per-head sizes in ``key_length_mla`` / ``value_length_mla``; ``q_lora_rank`` (when set),
``kv_lora_rank``, ``rope.dimension_count`` = qk_rope_head_dim, ``leading_dense_block_count``,
``expert_*`` (count, used, shared count, feed-forward length, weights scale, weights norm
when true, gating func 1 softmax / 2 sigmoid, group count / used count) and, for YaRN,
``rope.scaling.yarn_log_multiplier`` = 0.1 * mscale_all_dim.

Tensors: MLA projections ``attn_q`` or ``attn_q_a`` / ``attn_q_a_norm`` / ``attn_q_b``,
``attn_kv_a_mqa``, ``attn_kv_a_norm``; ``kv_b_proj`` split per head into ``attn_k_b``
``[H, R, Dn]`` (transposed) and ``attn_v_b`` ``[H, Dv, R]`` as current converters write it
(``split_kv_b=False`` writes the whole ``attn_kv_b`` and per-head key/value lengths, as
older converters did); router ``ffn_gate_inp``, V3's ``exp_probs_b.bias``, experts stacked
``ffn_{gate,up,down}_exps`` ``[E, out, in]``, shared experts ``ffn_*_shexp``. No rope row
permutation: llama.cpp's deepseek2 rope is NORM (interleaved pairs) like DeepSeek's own.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, Optional

import numpy as np

from .common import COMMON_LAYER_NAMES, QuantPlan, base_kv, gguf_tensor_name, write_gguf

ARCH = "deepseek2"
LAYER_NAMES = dict(
    COMMON_LAYER_NAMES,
    **{
        "self_attn.q_a_proj": "attn_q_a",
        "self_attn.q_a_layernorm": "attn_q_a_norm",
        "self_attn.q_b_proj": "attn_q_b",
        "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
        "self_attn.kv_a_layernorm": "attn_kv_a_norm",
        "self_attn.kv_b_proj": "attn_kv_b",
        "mlp.gate": "ffn_gate_inp",
        "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
        "mlp.shared_experts.up_proj": "ffn_up_shexp",
        "mlp.shared_experts.down_proj": "ffn_down_shexp",
    },
)
_EXPERT_RE = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
# transformers 5 holds the experts fused in memory (its save_pretrained splits them again).
_FUSED_RE = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up|down)_proj")
_BIAS_RE = re.compile(r"model\.layers\.(\d+)\.mlp\.gate\.e_score_correction_bias")


def metadata(cfg, split_kv_b: bool = True) -> Dict[str, object]:
    p = ARCH + "."
    v3 = cfg.model_type == "deepseek_v3"
    kv = base_kv(ARCH, cfg)
    rank, rope, nope, v = (
        cfg.kv_lora_rank,
        cfg.qk_rope_head_dim,
        cfg.qk_nope_head_dim,
        cfg.v_head_dim,
    )
    kv.update(
        {
            p + "attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps),
            p + "vocab_size": int(cfg.vocab_size),
            p + "leading_dense_block_count": int(cfg.first_k_dense_replace),
            p + "attention.kv_lora_rank": int(rank),
            p + "rope.dimension_count": int(rope),
            p + "expert_feed_forward_length": int(cfg.moe_intermediate_size),
            p + "expert_count": int(cfg.n_routed_experts),
            p + "expert_used_count": int(cfg.num_experts_per_tok),
            p + "expert_shared_count": int(cfg.n_shared_experts),
            p + "expert_weights_scale": float(cfg.routed_scaling_factor),
            p + "expert_gating_func": 2 if v3 else 1,
        }
    )
    if split_kv_b:
        kv.update(
            {
                p + "attention.head_count_kv": 1,
                p + "attention.key_length": rank + rope,
                p + "attention.value_length": rank,
                p + "attention.key_length_mla": nope + rope,
                p + "attention.value_length_mla": v,
            }
        )
    else:
        kv.update({p + "attention.key_length": nope + rope, p + "attention.value_length": v})
    if cfg.q_lora_rank:
        kv[p + "attention.q_lora_rank"] = int(cfg.q_lora_rank)
    if cfg.norm_topk_prob:
        kv[p + "expert_weights_norm"] = True
    if cfg.n_group:
        kv[p + "expert_group_count"] = int(cfg.n_group)
        kv[p + "expert_group_used_count"] = int(cfg.topk_group)
    kv.update(_yarn(cfg.rope_parameters or {}))
    return kv


def _yarn(rp) -> Dict[str, object]:
    if rp.get("rope_type") != "yarn":
        return {}
    if rp.get("mscale") != rp.get("mscale_all_dim"):
        raise ValueError("llama.cpp's deepseek2 assumes mscale == mscale_all_dim")
    p = ARCH + ".rope.scaling."
    return {
        p + "type": "yarn",
        p + "factor": float(rp["factor"]),
        p + "original_context_length": int(rp["original_max_position_embeddings"]),
        p + "yarn_log_multiplier": 0.1 * float(rp["mscale_all_dim"]),
        p + "yarn_beta_fast": float(rp.get("beta_fast") or 32.0),
        p + "yarn_beta_slow": float(rp.get("beta_slow") or 1.0),
    }


def tensors(model, split_kv_b: bool = True) -> Dict[str, np.ndarray]:
    cfg = model.config
    out: Dict[str, np.ndarray] = {}
    experts: Dict[tuple, Dict[int, np.ndarray]] = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        arr = t.detach().float().numpy().copy()
        m, fused, bias = (
            _EXPERT_RE.fullmatch(name),
            _FUSED_RE.fullmatch(name),
            _BIAS_RE.fullmatch(name),
        )
        if m:
            experts.setdefault((int(m.group(1)), m.group(3)), {})[int(m.group(2))] = arr
        elif fused and fused.group(2) == "down":
            out[f"blk.{fused.group(1)}.ffn_down_exps.weight"] = arr  # [E, H, I]
        elif fused:  # [E, 2I, H]: gate rows, then up rows
            gate, up = np.split(arr, 2, axis=1)
            out[f"blk.{fused.group(1)}.ffn_gate_exps.weight"] = np.ascontiguousarray(gate)
            out[f"blk.{fused.group(1)}.ffn_up_exps.weight"] = np.ascontiguousarray(up)
        elif bias:
            out[f"blk.{bias.group(1)}.exp_probs_b.bias"] = arr
        elif name.endswith("kv_b_proj.weight") and split_kv_b:
            out.update(_split_kv_b(gguf_tensor_name(name, LAYER_NAMES), arr, cfg))
        else:
            out[gguf_tensor_name(name, LAYER_NAMES)] = arr
    for (layer, proj), per_expert in sorted(experts.items()):
        out[f"blk.{layer}.ffn_{proj}_exps.weight"] = np.stack(
            [per_expert[e] for e in range(len(per_expert))]
        )
    return out


def _split_kv_b(gguf_name: str, w: np.ndarray, cfg) -> Dict[str, np.ndarray]:
    """``[H*(Dn+Dv), R]`` -> ``attn_k_b [H, R, Dn]`` (transposed) and ``attn_v_b [H, Dv, R]``."""
    per_head = w.reshape(
        cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, w.shape[-1]
    )
    k_b, v_b = per_head[:, : cfg.qk_nope_head_dim], per_head[:, cfg.qk_nope_head_dim :]
    return {
        gguf_name.replace("attn_kv_b", "attn_k_b"): np.ascontiguousarray(k_b.transpose(0, 2, 1)),
        gguf_name.replace("attn_kv_b", "attn_v_b"): np.ascontiguousarray(v_b),
    }


def export(model, path: Path, split_kv_b: bool = True, plan: Optional[QuantPlan] = None) -> Path:
    return write_gguf(path, ARCH, metadata(model.config, split_kv_b), tensors(model, split_kv_b),
                      plan)

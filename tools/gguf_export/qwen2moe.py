"""qwen2moe / qwen3moe: llama.cpp's Qwen2MoeModel converter conventions.

No Q/K permutation (NeoX rope in llama.cpp's graph for Qwen). Per-expert HF tensors
``mlp.experts.{e}.{gate,up,down}_proj.weight`` are stacked into one ``[E, out, in]`` tensor
per projection (``blk.N.ffn_{gate,up,down}_exps.weight``); the router is ``ffn_gate_inp``,
the shared expert ``ffn_*_shexp`` and its gate ``ffn_gate_inp_shexp``, a vector ``[H]``
(llama.cpp creates it as ``{n_embd}``; transformers' GGUF loader re-adds the leading 1).
Metadata adds ``expert_count``, ``expert_used_count``,
``expert_feed_forward_length`` and, with a shared expert,
``expert_shared_feed_forward_length``; ``attention.key_length`` / ``value_length`` when the
config names a head_dim (Qwen3-MoE).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, Optional

import numpy as np

from .common import COMMON_LAYER_NAMES, QuantPlan, base_kv, gguf_tensor_name, write_gguf

MOE_LAYER_NAMES = dict(COMMON_LAYER_NAMES, **{
    "mlp.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
})
_EXPERT_RE = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
# transformers 5 holds the experts fused in memory (its save_pretrained splits them again).
_FUSED_RE = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up|down)_proj")


def moe_kv(arch: str, cfg) -> Dict[str, object]:
    p = arch + "."
    kv = base_kv(arch, cfg)
    kv[p + "attention.layer_norm_rms_epsilon"] = float(cfg.rms_norm_eps)
    kv[p + "vocab_size"] = int(cfg.vocab_size)  # no tokenizer in these files to count
    kv[p + "expert_count"] = int(cfg.num_experts)
    kv[p + "expert_used_count"] = int(cfg.num_experts_per_tok)
    kv[p + "expert_feed_forward_length"] = int(cfg.moe_intermediate_size)
    if getattr(cfg, "shared_expert_intermediate_size", None):
        kv[p + "expert_shared_feed_forward_length"] = int(cfg.shared_expert_intermediate_size)
    head_dim = getattr(cfg, "head_dim", None)
    if head_dim:
        kv[p + "attention.key_length"] = int(head_dim)
        kv[p + "attention.value_length"] = int(head_dim)
    return kv


def moe_tensors(model) -> Dict[str, np.ndarray]:
    """GGUF-named tensors with each layer's experts stacked per projection."""
    out: Dict[str, np.ndarray] = {}
    experts: Dict[tuple, Dict[int, np.ndarray]] = {}
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and tied:
            continue
        arr = t.detach().float().numpy().copy()
        m, fused = _EXPERT_RE.fullmatch(name), _FUSED_RE.fullmatch(name)
        if m:
            layer, expert, proj = int(m.group(1)), int(m.group(2)), m.group(3)
            experts.setdefault((layer, proj), {})[expert] = arr
        elif fused and fused.group(2) == "down":
            out[f"blk.{fused.group(1)}.ffn_down_exps.weight"] = arr  # [E, H, I]
        elif fused:  # [E, 2I, H]: gate rows, then up rows
            gate, up = np.split(arr, 2, axis=1)
            out[f"blk.{fused.group(1)}.ffn_gate_exps.weight"] = np.ascontiguousarray(gate)
            out[f"blk.{fused.group(1)}.ffn_up_exps.weight"] = np.ascontiguousarray(up)
        elif name.endswith("shared_expert_gate.weight"):
            out[gguf_tensor_name(name, MOE_LAYER_NAMES)] = arr.reshape(-1)  # [1, H] -> [H]
        else:
            out[gguf_tensor_name(name, MOE_LAYER_NAMES)] = arr
    for (layer, proj), per_expert in sorted(experts.items()):
        stacked = np.stack([per_expert[e] for e in range(len(per_expert))])  # [E, out, in]
        out[f"blk.{layer}.ffn_{proj}_exps.weight"] = stacked
    return out


def export(model, path: Path, arch: str = "qwen2moe", plan: Optional[QuantPlan] = None) -> Path:
    return write_gguf(path, arch, moe_kv(arch, model.config), moe_tensors(model), plan)

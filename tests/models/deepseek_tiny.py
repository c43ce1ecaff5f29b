"""Tiny random DeepSeek V2 / V3 Hugging Face models for the parity tests.

Every special feature on: one dense layer then one MoE layer (first_k_dense_replace=1),
8 routed experts in 4 groups of which 2 are kept, 2 experts per token, shared experts,
routed_scaling_factor != 1, v_head_dim != qk_nope_head_dim, q_lora_rank set in V3 and
absent in V2 (V2-Lite style), YaRN with both mscales in V3.
"""

from __future__ import annotations

import torch
from transformers import (
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
)

from tests.models.family_harness import randomize_

COMMON = dict(
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=32,
    qk_rope_head_dim=16,
    qk_nope_head_dim=16,
    v_head_dim=12,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=4,
    topk_group=2,
    first_k_dense_replace=1,
    vocab_size=256,
    max_position_embeddings=128,
)
V3_YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 32,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 0.8,
}


def v2_config(**overrides) -> DeepseekV2Config:
    # topk_group=1 < top_k: with V2's best-expert group score, keeping 2 groups could never
    # change a top-2 choice.
    kw = dict(
        COMMON,
        q_lora_rank=None,
        n_shared_experts=2,
        topk_method="group_limited_greedy",
        topk_group=1,
        routed_scaling_factor=1.5,
        attention_bias=True,
        mlp_bias=True,
        norm_topk_prob=False,
    )
    kw.update(overrides)
    return DeepseekV2Config(**kw)


def v3_config(**overrides) -> DeepseekV3Config:
    kw = dict(
        COMMON,
        q_lora_rank=24,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        rope_parameters=dict(V3_YARN),
        rope_interleave=True,
    )
    kw.update(overrides)
    return DeepseekV3Config(**kw)


def build(cfg, seed: int = 0):
    """The HF model of ``cfg`` in float32 eager mode, with norms, biases, the router and
    V3's ``e_score_correction_bias`` perturbed so that each of them shows in the logits.
    Router weights are scaled up so that expert choices are far from ties."""
    torch.manual_seed(seed)
    cfg._attn_implementation = "eager"
    cls = DeepseekV3ForCausalLM if isinstance(cfg, DeepseekV3Config) else DeepseekV2ForCausalLM
    hf = cls(cfg).eval()
    randomize_(hf, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, t in list(hf.named_parameters()) + list(hf.named_buffers()):
            if name.endswith("mlp.gate.weight"):
                t.mul_(20.0)
            elif name.endswith("e_score_correction_bias"):
                t.copy_(torch.randn(t.shape, generator=g) * 0.2)
    return hf

"""Qwen2-MoE served by cvllm matches transformers: routed experts (8, top-2, fused path),
the sigmoid-gated shared expert, qkv bias, GQA; one variant with a dense layer
(mlp_only_layers) and norm_topk_prob, and the GGUF copy (llama.cpp arch ``qwen2moe``:
every layer sparse, top-k weights not renormalised)."""

import torch
from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

from tests.models.family_harness import check_against_hf, check_gguf_against_hf, randomize_, save_tiny


def _config(**kw):
    base = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                shared_expert_intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, vocab_size=256,
                max_position_embeddings=128)
    base.update(kw)
    return Qwen2MoeConfig(**base)


def _tiny(seed, **kw):
    torch.manual_seed(seed)
    hf = Qwen2MoeForCausalLM(_config(**kw))
    randomize_(hf, seed)
    return hf


def test_qwen2_moe_family(tmp_path):
    """Three layers: 0 and 2 sparse, 1 dense (mlp_only_layers); renormalised top-k."""
    hf = _tiny(0, num_hidden_layers=3, mlp_only_layers=[1], norm_topk_prob=True)
    check_against_hf(hf, save_tiny(hf, tmp_path))


def test_qwen2_moe_gguf(tmp_path):
    """All layers sparse, top-k weights not renormalised (llama.cpp's qwen2moe never does).
    transformers' GGUF loader reads no expert / shared-expert widths for qwen2moe and
    falls back to its config defaults (1408 / 5632): the tiny model uses those widths so
    transformers can read the same file."""
    from tools.gguf_export import qwen2moe

    hf = _tiny(2, moe_intermediate_size=1408, shared_expert_intermediate_size=5632)
    folder = save_tiny(hf, tmp_path)
    qwen2moe.export(hf, folder / "tiny.gguf")
    check_gguf_against_hf(hf, folder, "tiny.gguf", transformers_loads=True)

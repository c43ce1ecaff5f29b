"""Qwen3-MoE served by cvllm matches transformers: q/k norms, explicit head_dim, 8 experts
top-2 through the fused path, norm_topk_prob, GQA, one dense layer (mlp_only_layers), and
the GGUF copy (llama.cpp arch ``qwen3moe``)."""

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from tests.models.family_harness import check_against_hf, check_gguf_against_hf, randomize_, save_tiny


def _tiny(seed, **kw):
    base = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=24, num_experts=8,
                num_experts_per_tok=2, vocab_size=256, max_position_embeddings=128)
    base.update(kw)
    torch.manual_seed(seed)
    hf = Qwen3MoeForCausalLM(Qwen3MoeConfig(**base))
    randomize_(hf, seed)
    return hf


def test_qwen3_moe_family(tmp_path):
    """Layer 1 dense (mlp_only_layers), layers 0 and 2 sparse, renormalised top-k."""
    hf = _tiny(0, num_hidden_layers=3, mlp_only_layers=[1], norm_topk_prob=True)
    check_against_hf(hf, save_tiny(hf, tmp_path))


def test_qwen3_moe_gguf(tmp_path):
    """llama.cpp's qwen3moe always renormalises the top-k weights, and transformers' GGUF
    loader (norm_topk_prob=True for qwen3moe) reads no expert width, falling back to its
    default 768: the tiny model uses both so every reader agrees on the file."""
    from tools.gguf_export import qwen3moe

    hf = _tiny(1, norm_topk_prob=True, moe_intermediate_size=768)
    folder = save_tiny(hf, tmp_path)
    qwen3moe.export(hf, folder / "tiny.gguf")
    check_gguf_against_hf(hf, folder, "tiny.gguf", transformers_loads=True)

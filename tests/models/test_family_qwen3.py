"""Qwen3ForCausalLM against transformers: per-head q/k RMSNorm, head_dim != hidden/heads,
attention bias, GQA, tied embeddings, sliding-window layers; GGUF ``qwen3``."""

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from tests.models.family_harness import (check_against_hf, check_gguf_against_hf, cvllm_llm,
                                         randomize_, save_tiny)

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)


def test_qwen3_family(tmp_path):
    torch.manual_seed(0)
    cfg = Qwen3Config(**TINY, head_dim=32, attention_bias=True, tie_word_embeddings=True,
                      use_sliding_window=True, sliding_window=6, max_window_layers=1)
    hf = Qwen3ForCausalLM(cfg)
    randomize_(hf)  # q_norm / k_norm weights away from 1 so that they count
    folder = save_tiny(hf, tmp_path)
    llm = cvllm_llm(folder)
    layers = llm.engine.runner.model.model.layers
    assert [layer.self_attn.attn.sliding_window for layer in layers] == [None, 6]
    assert layers[0].self_attn.head_dim == 32
    check_against_hf(hf, folder, llm=llm)


def test_qwen3_gguf(tmp_path):
    from tools.gguf_export import qwen3 as gguf_qwen3

    torch.manual_seed(1)
    # head_dim 128 (not hidden/heads = 16): transformers' qwen3 GGUF reader ignores
    # attention.key_length and falls back to Qwen3Config's default head_dim of 128, so only
    # that value lets it read the same file. cvllm reads key_length (any head_dim).
    cfg = Qwen3Config(**TINY, head_dim=128, tie_word_embeddings=False)
    hf = Qwen3ForCausalLM(cfg)
    randomize_(hf)
    folder = save_tiny(hf, tmp_path)
    gguf_qwen3.export(hf, folder / "tiny.gguf")
    check_gguf_against_hf(hf, folder, "tiny.gguf", transformers_loads=True)

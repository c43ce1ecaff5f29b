"""Glm4ForCausalLM against transformers: GPT-J-style partial rotary (half of head_dim),
q/k/v bias with an unbiased o_proj, fused gate_up_proj, post-attention / post-MLP norms,
head_dim != hidden/heads, GQA; GGUF ``glm4`` (transformers cannot read glm4 GGUF files)."""

import torch
from transformers import Glm4Config, Glm4ForCausalLM

from tests.models.family_harness import (check_against_hf, check_gguf_against_hf, randomize_,
                                         save_tiny)

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, attention_bias=True, vocab_size=256,
            max_position_embeddings=128, pad_token_id=None, eos_token_id=2)


def test_glm4_family(tmp_path):
    torch.manual_seed(0)
    cfg = Glm4Config(**TINY, tie_word_embeddings=False)
    assert cfg.rope_parameters["partial_rotary_factor"] == 0.5
    hf = Glm4ForCausalLM(cfg)
    randomize_(hf)
    check_against_hf(hf, save_tiny(hf, tmp_path))


def test_glm4_gguf(tmp_path):
    from cvllm.loader.gguf_loader import gguf_config
    from tools.gguf_export import glm4 as gguf_glm4

    torch.manual_seed(1)
    hf = Glm4ForCausalLM(Glm4Config(**TINY, tie_word_embeddings=True))
    randomize_(hf)
    folder = save_tiny(hf, tmp_path)
    gguf_glm4.export(hf, folder / "tiny.gguf")
    cfg = gguf_config(folder / "tiny.gguf")
    assert cfg["partial_rotary_factor"] == 0.5 and cfg["head_dim"] == 32
    assert cfg["tie_word_embeddings"] and cfg["attention_bias"]
    check_gguf_against_hf(hf, folder, "tiny.gguf", transformers_loads=False)

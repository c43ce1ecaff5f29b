"""LlamaForCausalLM through the real engine against transformers: plain, every rope
scaling the family uses (llama3, linear, dynamic, yarn), tied embeddings with biases, and
the GGUF copy (llama.cpp's Q/K permutation)."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tests.models.family_harness import check_against_hf, check_gguf_against_hf, randomize_, save_tiny

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=128)
VARIANTS = {
    "plain": {},
    "llama3": dict(rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 16}),
    "linear": dict(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 3.0}),
    # HF only rescales dynamic NTK past the original context; served within it, both agree.
    "dynamic": dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}),
    "yarn": dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                  "original_max_position_embeddings": 32}),
    "tied_bias": dict(tie_word_embeddings=True, attention_bias=True, mlp_bias=True),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_llama_family(tmp_path, variant):
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**TINY, **VARIANTS[variant]))
    randomize_(hf)
    # Rope variants do not change how KV blocks are shared: one prefix-cache check.
    check_against_hf(hf, save_tiny(hf, tmp_path), prefix_cache=variant == "plain")


def test_llama_gguf(tmp_path):
    from tools.gguf_export import llama as gguf_llama

    torch.manual_seed(1)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)
    hf = LlamaForCausalLM(cfg)
    randomize_(hf)
    folder = save_tiny(hf, tmp_path)
    gguf_llama.export(hf, folder / "tiny.gguf")
    check_gguf_against_hf(hf, folder, "tiny.gguf")

"""Qwen3-Next and the Qwen3.5 text models (hybrid gated DeltaNet + gated full attention)
served from tiny HF folders through the real engine, against transformers: batched
prefill logits, greedy tokens, and greedy with a prefill chunk of 4 (the conv and
recurrent states carry across chunks). No GGUF: transformers cannot load llama.cpp's
``qwen3next`` files. The layer math alone is tested in tests/layers/test_gated_deltanet.py;
the model with hand-built metadata (no scheduler) in test_qwen3_next_model.py."""

import pytest
import torch
from transformers import (
    Qwen3_5ForCausalLM,
    Qwen3_5MoeForCausalLM,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig

from tests.models.family_harness import check_against_hf, randomize_, save_tiny

# GQA in both kinds of layer: 4 query / 2 KV heads, 2 key / 4 value linear heads.
COMMON = dict(vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
              linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
              linear_conv_kernel_dim=4, max_position_embeddings=128)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
           shared_expert_intermediate_size=48)


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny matmuls gain nothing from threads; on a shared CPU the thread hand-offs cost
    milliseconds per op."""
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


def qwen3_next_config():
    # layer_types from full_attention_interval (3 linear + 1 full); a dense layer among the
    # MoE ones; attention biases; unnormalised top-k.
    return Qwen3NextConfig(**COMMON, **MOE, intermediate_size=96, mlp_only_layers=[1],
                           norm_topk_prob=False, attention_bias=True)


def qwen3_5_config():
    return Qwen3_5TextConfig(**COMMON, intermediate_size=96, tie_word_embeddings=True,
                             layer_types=["linear_attention", "full_attention"] * 2)


def qwen3_5_moe_config():
    return Qwen3_5MoeTextConfig(**COMMON, **MOE)


def _check(cls, cfg, folder, seed, prefix_cache=False):
    torch.manual_seed(seed)
    hf = cls(cfg)
    randomize_(hf)
    check_against_hf(hf, save_tiny(hf, folder), prefix_cache=prefix_cache)


def test_qwen3_next_family(tmp_path):
    # The hybrid families run with prefix caching off (state layers): checked once.
    _check(Qwen3NextForCausalLM, qwen3_next_config(), tmp_path, 0, prefix_cache=True)


def test_qwen3_5_family(tmp_path):
    _check(Qwen3_5ForCausalLM, qwen3_5_config(), tmp_path, 1)


def test_qwen3_5_moe_family(tmp_path):
    _check(Qwen3_5MoeForCausalLM, qwen3_5_moe_config(), tmp_path, 2)

"""StableLmForCausalLM served by cvllm against transformers: LayerNorms with bias, partial
rotary, GQA, per-head qk LayerNorm, q/k/v bias, in both residual layouts (parallel and
sequential); and the same family from a llama.cpp ``stablelm`` GGUF."""

import pytest
import torch
from transformers import StableLmConfig, StableLmForCausalLM

from tests.models.family_harness import (check_against_hf, check_gguf_against_hf, randomize_,
                                         save_tiny)


def _tiny(seed: int, **overrides) -> StableLmForCausalLM:
    torch.manual_seed(seed)
    kw = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=256, max_position_embeddings=128,
              partial_rotary_factor=0.25, rope_theta=10000.0, layer_norm_eps=1e-5,
              use_qkv_bias=True, qk_layernorm=True, use_parallel_residual=True,
              bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    kw.update(overrides)
    hf = StableLmForCausalLM(StableLmConfig(**kw))
    randomize_(hf)
    return hf.eval()


@pytest.mark.parametrize("parallel", [True, False])
def test_stablelm_family(tmp_path, parallel):
    hf = _tiny(0, use_parallel_residual=parallel)
    check_against_hf(hf, save_tiny(hf, tmp_path), prefix_cache=parallel)


def test_stablelm_gguf(tmp_path):
    """What transformers' stablelm GGUF loader reads back (it derives use_qkv_bias and
    use_parallel_residual from the tensors, keeps the default partial rotary 0.25 and
    rope_theta, and has no qk_layernorm flag), so it must load the file to HF's logits."""
    from tools.gguf_export import stablelm as gguf_stablelm

    hf = _tiny(1, qk_layernorm=False, use_parallel_residual=False)
    folder = save_tiny(hf, tmp_path)
    gguf_stablelm.export(hf, folder / "tiny.gguf")
    check_gguf_against_hf(hf, folder, "tiny.gguf", transformers_loads=True)


def test_stablelm_gguf_qk_norm(tmp_path):
    """Per-head q/k norms stacked [heads, head_dim] as llama.cpp's converter writes them."""
    from tools.gguf_export import stablelm as gguf_stablelm

    hf = _tiny(2, partial_rotary_factor=0.5, tie_word_embeddings=True)
    folder = save_tiny(hf, tmp_path)
    gguf_stablelm.export(hf, folder / "tiny.gguf")
    check_gguf_against_hf(hf, folder, "tiny.gguf", transformers_loads=False)

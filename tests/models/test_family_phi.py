"""PhiForCausalLM (Phi-2) served by cvllm against transformers: parallel attention + MLP from
one LayerNorm with bias, partial rotary, biases everywhere (LM head included), gelu_new,
GQA and qk_layernorm switched on; and the same family from a llama.cpp ``phi2`` GGUF."""

import pytest
import torch
from transformers import PhiConfig, PhiForCausalLM

from tests.models.family_harness import (check_against_hf, check_gguf_against_hf, randomize_,
                                         save_tiny)


def _tiny(seed: int, **overrides) -> PhiForCausalLM:
    torch.manual_seed(seed)
    kw = dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=256, max_position_embeddings=128,
              partial_rotary_factor=0.5, hidden_act="gelu_new", qk_layernorm=True,
              layer_norm_eps=1e-5, tie_word_embeddings=False)
    kw.update(overrides)
    hf = PhiForCausalLM(PhiConfig(**kw))
    randomize_(hf)
    return hf.eval()


def test_phi_family(tmp_path):
    hf = _tiny(0)
    check_against_hf(hf, save_tiny(hf, tmp_path))


@pytest.mark.parametrize("fused_qkv", [True, False])
def test_phi_gguf(tmp_path, fused_qkv):
    """llama.cpp's phi2: attn_qkv fused (the published files) or split, with biases,
    output.bias, no qk norm, MHA (its converter writes head_count_kv = head_count).
    transformers has no phi2 GGUF loader."""
    from tools.gguf_export import phi2 as gguf_phi2

    hf = _tiny(1, num_key_value_heads=4, qk_layernorm=False, partial_rotary_factor=0.4)
    folder = save_tiny(hf, tmp_path)
    gguf_phi2.export(hf, folder / "tiny.gguf", fused_qkv=fused_qkv)
    check_gguf_against_hf(hf, folder, "tiny.gguf", transformers_loads=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layernorm_and_gelu_new_match_torch(dtype):
    """The two layers Phi-2 adds: LayerNorm (bias, residual contract) and plain gelu_new."""
    from transformers.activations import ACT2FN

    from cvllm.layers.activation import get_act_fn
    from cvllm.layers.layernorm import LayerNorm

    ref = torch.nn.LayerNorm(16, eps=1e-5)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(16).to(dtype))  # values the dtype can hold
        ref.bias.copy_(torch.randn(16).to(dtype))
    ours = LayerNorm(16, 1e-5, dtype)
    ours.weight.data.copy_(ref.weight)
    ours.bias.data.copy_(ref.bias)
    x, res = torch.randn(5, 16).to(dtype), torch.randn(5, 16).to(dtype)
    want = ref(x.float()).to(dtype)
    torch.testing.assert_close(ours(x), want, rtol=0, atol=1e-6)
    out, new_res = ours(x, res)
    torch.testing.assert_close(new_res, x + res, rtol=0, atol=0)
    torch.testing.assert_close(out, ref((x + res).float()).to(dtype), rtol=0, atol=1e-6)
    y = torch.randn(100) * 4
    torch.testing.assert_close(get_act_fn("gelu_new")(y), ACT2FN["gelu_new"](y),
                               rtol=1e-5, atol=1e-6)

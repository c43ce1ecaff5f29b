"""Rotary embeddings against transformers' own rope functions and Llama rotation."""

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from cvllm.layers.rotary import get_rope, rope_parameters_from_config

HEAD_DIM, MAX_POS = 32, 512

ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "yarn": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 128,
    },
    "yarn_mscale": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 40.0,
        "beta_fast": 16,
        "beta_slow": 2,
        "mscale": 0.707,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 128,
    },
}


def hf_config(params):
    return LlamaConfig(
        hidden_size=4 * HEAD_DIM,
        num_attention_heads=4,
        head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POS,
        rope_parameters=dict(params),
    )


def ours(cfg):
    return get_rope(
        HEAD_DIM, MAX_POS, rope_parameters_from_config(cfg.to_dict()), cfg.max_position_embeddings
    )


@pytest.mark.parametrize("name", list(ROPES))
def test_inv_freq_and_scaling_match_transformers(name):
    cfg = hf_config(ROPES[name])
    rope_type = cfg.rope_parameters["rope_type"]
    if rope_type == "default":
        inv_freq, attn_factor = LlamaRotaryEmbedding.compute_default_rope_parameters(cfg)
    elif rope_type == "dynamic":
        # Served within the original context: HF never rescales, so neither do we.
        inv_freq, attn_factor = LlamaRotaryEmbedding.compute_default_rope_parameters(cfg)
    else:
        inv_freq, attn_factor = ROPE_INIT_FUNCTIONS[rope_type](cfg, "cpu")
    rope = ours(cfg)
    torch.testing.assert_close(rope._compute_inv_freq(), inv_freq.float(), rtol=1e-6, atol=0)
    assert rope.mscale == pytest.approx(attn_factor, rel=1e-6)
    assert (
        rope.cos_sin_cache.shape == (MAX_POS, HEAD_DIM)
        and rope.cos_sin_cache.dtype == torch.float32
    )


@pytest.mark.parametrize("name", ["default", "linear", "llama3", "yarn", "yarn_mscale"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotation_matches_hf_llama(name, dtype):
    cfg = hf_config(ROPES[name])
    g = torch.Generator().manual_seed(0)
    T, H, Hkv = 11, 4, 2
    positions = torch.randint(0, MAX_POS, (T,), generator=g)
    q = torch.randn(T, H * HEAD_DIM, generator=g).to(dtype)
    k = torch.randn(T, Hkv * HEAD_DIM, generator=g).to(dtype)
    q_out, k_out = ours(cfg)(positions, q, k)
    cos, sin = LlamaRotaryEmbedding(cfg)(q, positions[None])  # [1, T, D]
    q_hf = q.view(1, T, H, HEAD_DIM).transpose(1, 2)
    k_hf = k.view(1, T, Hkv, HEAD_DIM).transpose(1, 2)
    q_ref, k_ref = apply_rotary_pos_emb(q_hf, k_hf, cos, sin)
    assert q_out.dtype == dtype and q_out.shape == q.shape
    torch.testing.assert_close(q_out, q_ref.transpose(1, 2).reshape(T, -1), rtol=0, atol=0)
    torch.testing.assert_close(k_out, k_ref.transpose(1, 2).reshape(T, -1), rtol=0, atol=0)


def test_old_config_format_is_read():
    p = rope_parameters_from_config(
        {"rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}}
    )
    assert (
        p["rope_type"] == "linear"
        and p["rope_theta"] == 5e5
        and p["factor"] == 2.0
        and "type" not in p
    )
    assert rope_parameters_from_config({})["rope_type"] == "default"
    assert rope_parameters_from_config({})["rope_theta"] == 10000.0
    with pytest.raises(ValueError, match="unsupported rope_type"):
        get_rope(HEAD_DIM, 16, {"rope_type": "no_such_rope"}, 16)


def test_gptj_style_and_partial_rotary():
    rope = get_rope(
        8,
        64,
        {"rope_type": "default", "rope_theta": 100.0, "partial_rotary_factor": 0.5},
        64,
        is_neox_style=False,
    )
    assert rope.rotary_dim == 4
    positions = torch.tensor([0, 3, 17])
    x = torch.randn(3, 2, 8)  # [T, heads, head_size]
    out, _ = rope(positions, x)
    # GPT-J rotates pairs (x0, x1), (x2, x3) as complex numbers.
    inv_freq = 1.0 / (100.0 ** (torch.arange(0, 4, 2).float() / 4))
    angle = positions[:, None].float() * inv_freq  # [T, 2]
    pairs = torch.view_as_complex(x[..., :4].reshape(3, 2, 2, 2).contiguous())
    want = torch.view_as_real(pairs * torch.polar(torch.ones_like(angle), angle)[:, None]).reshape(
        3, 2, 4
    )
    torch.testing.assert_close(out[..., :4], want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[..., 4:], x[..., 4:], rtol=0, atol=0)


def test_dynamic_served_past_original_context_is_fixed_at_scaled_length():
    # Beyond the original context HF rescales per forward; a paged cache cannot, so (like
    # vLLM) the frequencies are fixed at HF's value for the scaled length.
    cfg = hf_config(ROPES["dynamic"])
    seq_len = int(MAX_POS * cfg.rope_parameters["factor"])
    inv_freq, _ = ROPE_INIT_FUNCTIONS["dynamic"](cfg, "cpu", seq_len=seq_len)
    rope = get_rope(HEAD_DIM, seq_len, rope_parameters_from_config(cfg.to_dict()), MAX_POS)
    torch.testing.assert_close(rope._compute_inv_freq(), inv_freq.float(), rtol=1e-6, atol=0)

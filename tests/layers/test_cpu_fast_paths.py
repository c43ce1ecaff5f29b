"""The CPU fast paths of rotary and RMSNorm: bit-equal to the plain torch formulas."""

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from cvllm.layers.layernorm import RMSNorm, _rms_norm_cpu
from cvllm.layers.rotary import RotaryEmbedding, _adjacent


def _generic(rope: RotaryEmbedding, positions, x):
    """``RotaryEmbedding._rotate``, the general path, at ``positions``."""
    cos, sin = rope.cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)
    return rope._rotate(x, cos, sin)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fused", [True, False])
def test_neox_fast_path_is_bit_equal(dtype, fused):
    D, H, Hkv, T = 64, 9, 3, 5
    rope = RotaryEmbedding(D, D, 256, 10000.0)
    qkv = torch.randn(T, (H + 2 * Hkv) * D).to(dtype)
    q, k, _ = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
    if not fused:
        q, k = q.clone(), k.clone()
    assert (_adjacent(q, k) is not None) == fused
    pos = torch.tensor([0, 3, 17, 100, 255])
    q_rot, k_rot = rope(pos, q, k)
    assert q_rot.shape == q.shape and k_rot.shape == k.shape
    assert torch.equal(q_rot, _generic(rope, pos, q))
    assert torch.equal(k_rot, _generic(rope, pos, k))


def test_rows_memo_follows_refilled_positions():
    rope = RotaryEmbedding(16, 16, 64, 10000.0)
    x = torch.randn(3, 2 * 16)
    pos = torch.tensor([1, 2, 3])
    rope(pos, x)
    pos += 10  # the same tensor, refilled: the memo must not answer for the old values
    assert torch.equal(rope(pos, x)[0], _generic(rope, pos, x))


def test_adjacent_refuses_what_is_not_one_projection():
    a = torch.randn(4, 48)
    assert _adjacent(a[:, :16], a[:, 16:32]) is not None
    assert _adjacent(a[:, :16], a[:, 32:48]) is None  # a gap between them
    assert _adjacent(a[:, 16:32], a[:, :16]) is None  # k before q


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden", [16, 576, 4096])
def test_rms_norm_cpu_is_bit_equal_to_hf(dtype, hidden):
    hf = LlamaRMSNorm(hidden, eps=1e-5).to(dtype)
    hf.weight.data.copy_(torch.randn(hidden))
    x = (torch.randn(7, hidden) * 4).to(dtype)
    assert torch.equal(_rms_norm_cpu(x, hf.weight.data, 1e-5), hf(x))
    norm = RMSNorm(hidden, eps=1e-5, params_dtype=dtype)
    norm.weight.data.copy_(hf.weight.data)
    assert torch.equal(norm(x), hf(x))

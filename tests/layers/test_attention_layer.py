"""The attention layer's rotary dispatch: a backend that declares ``fused_rope`` gets the
rotation as ``RopeInputs`` and unrotated q / k; any other backend gets q / k rotated once
by the layer. Backends are stubs that record their call; CPU, in seconds."""

from __future__ import annotations

import pytest
import torch

from cvllm.attention.interface import AttentionBackend, AttentionCapabilities
from cvllm.layers.attention import Attention
from cvllm.layers.rotary import get_rope

H, HKV, D, T = 4, 2, 8, 3


class _Meta:
    def view(self, window):
        return self


class _Recorder(AttentionBackend):
    """A backend stand-in: keeps what ``forward`` got, returns zeros."""

    name = "stub"

    def __init__(self, fuses: bool):
        self.capabilities = AttentionCapabilities(fused_rope=fuses)
        self.calls = []

    def forward(self, q, k, v, kv_cache, meta, params, rope=None, out=None):
        kw = {} if rope is None else {"rope": rope}
        self.calls.append((q.clone(), k.clone(), kw))
        return torch.zeros_like(q)


def _inputs():
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(T, (H + 2 * HKV) * D, generator=g)
    q, k, v = qkv.split([H * D, HKV * D, HKV * D], dim=-1)
    return q, k, v, torch.tensor([0, 5, 9])


@pytest.mark.parametrize("fuses", [True, False])
def test_rotation_goes_to_a_fusing_backend_else_happens_once_here(fuses):
    layer = Attention(H, D, D**-0.5, HKV, backend=_Recorder(fuses))
    rope = get_rope(D, 64, {"rope_type": "default", "rope_theta": 10000.0}, 64)
    q, k, v, positions = _inputs()
    want_q, want_k = rope(positions, q.clone(), k.clone())
    layer(q.clone(), k.clone(), v, None, _Meta(), positions, rope)
    [(got_q, got_k, kw)] = layer.backend.calls
    if fuses:
        r = kw["rope"]
        assert r.positions is positions or torch.equal(r.positions, positions)
        assert r.cos_sin_cache is rope.cos_sin_cache and r.head_size == D and r.is_neox_style
        assert torch.equal(got_q.reshape(T, -1), q) and torch.equal(got_k.reshape(T, -1), k)
    else:
        assert "rope" not in kw
        assert torch.equal(got_q.reshape(T, -1), want_q)
        assert torch.equal(got_k.reshape(T, -1), want_k)
        assert not torch.equal(want_q, q)  # the rotation did something


def test_no_rotary_passes_q_k_through_and_rotary_needs_positions():
    layer = Attention(H, D, D**-0.5, HKV, backend=_Recorder(True))
    q, k, v, _ = _inputs()
    layer(q, k, v, None, _Meta())
    [(got_q, _, kw)] = layer.backend.calls
    assert kw == {} and torch.equal(got_q.reshape(T, -1), q)
    rope = get_rope(D, 64, {"rope_type": "default", "rope_theta": 10000.0}, 64)
    with pytest.raises(ValueError, match="positions"):
        layer(q, k, v, None, _Meta(), None, rope)

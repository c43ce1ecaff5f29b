"""The attention backend interface (``attention/interface.py``): what each backend
declares, how a missing capability is refused (at construction or start-up, with the
backend's name), the layer parameters, the backend's way from ``--attention-backend``
through ``EngineConfig`` to ``ModelConfig`` and the layers, the room left for speculative
verification (``decode_query_len``), and the torch reference's non-causal (encoder)
attention against plain torch SDPA. CPU, in seconds."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from cvllm.attention.backend import get_attn_backend
from cvllm.attention.backends import torch_ref
from cvllm.attention.backends.torch_ref_mla import TorchRefMLABackend
from cvllm.attention.interface import (
    AttentionBackend,
    AttentionCapabilities,
    AttentionParams,
    MLABackend,
)
from cvllm.attention.metadata import AttentionMetadata
from cvllm.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig, SchedulerConfig
from cvllm.layers.attention import Attention, require_capabilities


def test_backends_declare_their_capabilities():
    ref, tri = get_attn_backend("torch_ref"), get_attn_backend("triton")
    assert isinstance(ref, AttentionBackend) and isinstance(tri, AttentionBackend)
    assert ref.capabilities == AttentionCapabilities(fp8_cache=True, non_causal=True)
    assert tri.capabilities == AttentionCapabilities(
        fused_rope=True, takes_out=True, fp8_cache=True, cuda_graphs=True, split_graphs=True)
    assert not ref.capabilities.multi_token_decode and not tri.capabilities.multi_token_decode
    mla = TorchRefMLABackend()
    assert isinstance(mla, MLABackend) and mla.capabilities == AttentionCapabilities()
    assert get_attn_backend("torch_ref") is ref  # one stateless instance per name


def test_a_missing_capability_is_refused_by_name():
    tri = get_attn_backend("triton")
    tri.require("fused_rope", "cuda_graphs")  # has them: nothing happens
    with pytest.raises(NotImplementedError, match="triton does not implement multi_token_decode"):
        tri.require("fused_rope", "multi_token_decode")
    with pytest.raises(ValueError, match="no attention capability"):
        tri.require("fuses_rope")  # a typo is no capability
    with pytest.raises(NotImplementedError, match="triton does not implement non_causal"):
        Attention(4, 8, 0.3, 2, backend="triton", causal=False)  # at construction
    model = torch.nn.ModuleList([Attention(4, 8, 0.3, 2, backend="torch_ref")])
    require_capabilities(model, "fp8_cache", "non_causal")
    with pytest.raises(NotImplementedError, match="torch_ref does not implement cuda_graphs"):
        require_capabilities(model, "cuda_graphs")


def test_layer_params_are_normalised_once():
    p = AttentionParams(1, 0, 0)
    assert (p.scale, p.sliding_window, p.softcap, p.causal) == (1.0, None, None, True)
    assert isinstance(p.scale, float)
    p = AttentionParams(0.5, np.int64(6), 30)
    assert p.sliding_window == 6 and type(p.sliding_window) is int and p.softcap == 30.0
    with pytest.raises(ValueError, match="sliding window needs causal"):
        AttentionParams(0.5, 6, causal=False)
    layer = Attention(4, 8, 0.3, 2, sliding_window=6, logits_soft_cap=20.0, backend="torch_ref")
    assert layer.params == AttentionParams(0.3, 6, 20.0)


def test_the_backend_comes_from_the_engine_config():
    def engine(backend, device):
        hf = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, vocab_size=64)
        return EngineConfig(model=ModelConfig("X", hf), cache=CacheConfig(),
                            scheduler=SchedulerConfig(), device=DeviceConfig(device),
                            attention_backend=backend)

    assert engine("auto", "cpu").model.attention_backend == "torch_ref"
    assert engine("auto", "cuda").model.attention_backend == "triton"
    assert engine("triton", "cpu").model.attention_backend == "triton"
    assert engine("torch_ref", "cuda").model.attention_backend == "torch_ref"
    assert engine("auto", "cpu").attention_backend == "auto"  # the flag as given
    with pytest.raises(ValueError, match="attention backend"):
        ModelConfig("X", dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                              vocab_size=64), attention_backend="flash")
    assert Attention(4, 8, 0.3, backend="triton").backend.name == "triton"
    assert Attention(4, 8, 0.3).backend.name == "torch_ref"  # by hand, on the CPU: auto
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_attn_backend("flash")


def test_decode_query_len_leaves_room_for_verification():
    """Speculative verification: decode sequences of ``1 + drafts`` tokens each. Today's
    builders leave it at 1; ``build`` counts the leading sequences of that length."""
    def build(qlens, decode_query_len=1):
        qsl = np.concatenate([[0], np.cumsum(qlens)])
        lens = np.array(qlens) + 5
        return AttentionMetadata.build(
            slot_mapping=np.arange(qsl[-1]), query_start_loc=qsl, seq_lens=lens,
            block_tables=np.zeros((len(qlens), 2), np.int64), device="cpu",
            decode_query_len=decode_query_len)

    m = build([1, 1, 3, 3, 1])
    assert (m.decode_query_len, m.num_decodes) == (1, 2)
    m = build([3, 3, 1, 3], decode_query_len=3)
    assert (m.decode_query_len, m.num_decodes, m.prefill_max_query_len) == (3, 2, 3)
    with pytest.raises(ValueError, match="decode_query_len"):
        build([1], decode_query_len=0)


def _sdpa_per_sequence(q, k, v, qsl, scale):
    """Plain torch SDPA, one sequence at a time, K/V heads repeated for GQA."""
    outs = []
    for t0, t1 in zip(qsl[:-1], qsl[1:]):
        g = q.shape[1] // k.shape[1]
        qq, kk, vv = (x[t0:t1].transpose(0, 1) for x in (q, k.repeat_interleave(g, 1),
                                                         v.repeat_interleave(g, 1)))
        outs.append(F.scaled_dot_product_attention(qq, kk, vv, scale=scale).transpose(0, 1))
    return torch.cat(outs)


@pytest.mark.parametrize("heads", [(4, 2), (4, 4), (6, 1)])
def test_torch_ref_non_causal_matches_plain_sdpa(heads):
    """Encoder attention (``causal=False``): every query of a sequence sees every key of
    that sequence's tokens in the step, none of another's; no cache; padding rows zero."""
    g = torch.Generator().manual_seed(0)
    h, hkv, d, lens, pad = *heads, 16, [5, 1, 9], 2
    T = sum(lens)
    q, k, v = (torch.randn(T + pad, n, d, generator=g) for n in (h, hkv, hkv))
    qsl = np.concatenate([[0], np.cumsum(lens)])
    meta = AttentionMetadata.build(slot_mapping=np.full(T, -1), query_start_loc=qsl,
                                   seq_lens=np.array(lens), block_tables=np.zeros((3, 0)),
                                   device="cpu")
    layer = Attention(h, d, d**-0.5, hkv, backend="torch_ref", causal=False)
    got = layer(q.reshape(T + pad, -1), k.reshape(T + pad, -1), v.reshape(T + pad, -1), None,
                meta).view(T + pad, h, d)
    want = _sdpa_per_sequence(q, k, v, qsl, d**-0.5)
    torch.testing.assert_close(got[:T], want, atol=1e-5, rtol=1e-5)
    assert torch.all(got[T:] == 0)
    capped = torch_ref.forward(q, k, v, None, meta, AttentionParams(d**-0.5, softcap=1e4,
                                                                     causal=False))
    torch.testing.assert_close(capped[:T], want, atol=1e-4, rtol=1e-4)  # a far cap: ~none

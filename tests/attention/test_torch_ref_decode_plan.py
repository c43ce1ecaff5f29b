"""The torch reference backend's per-step decode plan (``_decode_plan``): built once per
metadata, shared by every layer, and right with and without a mask."""

import math

import pytest
import torch

from cvllm.attention.backends import torch_ref
from cvllm.attention.interface import AttentionParams
from cvllm.attention.kv_cache import KVCache
from tests.attention.test_torch_ref_attention import make_batch, naive_attention


def _check(seqs, seed, consecutive=False, **opts):
    q, k, v, cache, meta, fk, fv = make_batch(seqs, 4, 2, 16, 4, seed, consecutive=consecutive)
    scale = 1 / math.sqrt(16)
    out = torch_ref.forward(q, k, v, cache, meta, AttentionParams(scale, **opts))
    torch.testing.assert_close(out.double(), naive_attention(q, fk, fv, seqs, scale, **opts),
                               atol=1e-5, rtol=1e-5)
    return meta


@pytest.mark.parametrize("opts", [{}, {"sliding_window": 4}, {"sliding_window": 64},
                                  {"softcap": 3.0}])
def test_equal_length_decodes_take_the_unmasked_plan(opts):
    meta = _check([(11, 1), (11, 1), (11, 1)], seed=7, **opts)
    (plan,) = [p for key, p in meta.host_cache.items() if key[0] == "torch_ref.decode"]
    (group,) = plan
    window = opts.get("sliding_window")
    assert (group[4] is None) == (window is None or window >= 12)


def test_one_plan_serves_every_layer_of_the_step():
    """Two 'layers' (own caches and queries, same metadata): the second reuses the plan."""
    seqs = [(9, 1), (3, 1), (17, 1)]
    q, k, v, cache, meta, fk, fv = make_batch(seqs, 4, 2, 16, 4, seed=8)
    cache2 = KVCache(cache.k.clone(), cache.v.clone())
    for qq, c in ((q, cache), (torch.randn_like(q), cache2)):
        out = torch_ref.forward(qq, k, v, c, meta, AttentionParams(0.25))
        torch.testing.assert_close(out.double(), naive_attention(qq, fk, fv, seqs, 0.25),
                                   atol=1e-5, rtol=1e-5)
    assert len(meta.host_cache) == 1


def test_group_views_keep_their_own_cache():
    meta = _check([(5, 1), (9, 1)], seed=10)
    assert meta.host_cache
    import dataclasses

    assert dataclasses.replace(meta).host_cache == {}


@pytest.mark.parametrize("opts", [{}, {"sliding_window": 4}, {"softcap": 3.0}])
@pytest.mark.parametrize("consecutive", [True, False])
def test_lone_sequence_with_consecutive_blocks_reads_the_cache_in_place(opts, consecutive):
    """One decoding sequence whose block ids are consecutive: the plan records the run
    (attention then takes views of the cache, no gather), with the same output."""
    meta = _check([(13, 1)], seed=11, consecutive=consecutive, **opts)
    (plan,) = [p for key, p in meta.host_cache.items() if key[0] == "torch_ref.decode"]
    (group,) = plan
    assert (group[5] == 3) if consecutive else (group[5] is None)


def test_several_sequences_never_take_the_run():
    meta = _check([(13, 1), (6, 1)], seed=12, consecutive=True)
    (plan,) = [p for key, p in meta.host_cache.items() if key[0] == "torch_ref.decode"]
    assert all(group[5] is None for group in plan)


@pytest.mark.parametrize("length", [1, 13, 40])
def test_lone_float32_stream_takes_the_short_path_with_the_same_bits(length):
    """``forward``'s ``_decode_run`` (a lone float32 stream, every key visible) gives
    exactly what the general group path gives on the same plan."""
    q, k, v, cache, meta, fk, fv = make_batch([(length, 1)], 4, 2, 16, 4, seed=13,
                                              consecutive=True)
    out = torch_ref.forward(q, k, v, cache, meta, AttentionParams(0.25))
    (plan,) = [p for key, p in meta.host_cache.items() if key[0] == "torch_ref.decode"]
    (group,) = plan
    assert group[5] is not None and group[4] is None
    general = torch_ref._decode_group(q, cache, group, AttentionParams(0.25))
    assert torch.equal(out, general)
    torch.testing.assert_close(out.double(), naive_attention(q, fk, fv, [(length, 1)], 0.25),
                               atol=1e-5, rtol=1e-5)

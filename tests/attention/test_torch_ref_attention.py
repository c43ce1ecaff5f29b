"""The torch reference attention backend against a naive per-sequence implementation."""

import math

import numpy as np
import pytest
import torch

from cvllm.attention.backends import torch_ref
from cvllm.attention.interface import AttentionParams
from cvllm.attention.kv_cache import KVCache, KVCacheSpec, allocate_kv_cache
from cvllm.attention.metadata import AttentionMetadata


def make_batch(
    seqs, block_size, num_kv_heads, head_dim, num_heads, seed=0, num_blocks=64, dtype=torch.float32,
    consecutive=False,
):
    """``seqs``: (cached context length, new tokens) per sequence, in batch order.
    Caches the context, returns (q, k, v, cache, meta, per-seq full K/V) for the step.
    Block ids are a random permutation, or with ``consecutive`` 3, 4, 5, ... in order."""
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    spec = KVCacheSpec(1, num_kv_heads, head_dim, block_size, dtype)
    cache = allocate_kv_cache(spec, num_blocks, "cpu")[0]
    if consecutive:
        free = list(range(num_blocks - 1, 2, -1))  # pops 3, 4, 5, ...
    else:
        free = list(rng.permutation(num_blocks))  # non-contiguous block ids
    max_blocks = max(-(-(c + n) // block_size) for c, n in seqs)
    block_tables = np.full((len(seqs), max_blocks + 1), -1, dtype=np.int32)  # padded with -1
    qsl, seq_lens, slots, full_k, full_v = [0], [], [], [], []
    qs, ks, vs = [], [], []
    for b, (ctx, n) in enumerate(seqs):
        nb = -(-(ctx + n) // block_size)
        block_tables[b, :nb] = [free.pop() for _ in range(nb)]
        pos_slots = [
            block_tables[b, p // block_size] * block_size + p % block_size for p in range(ctx + n)
        ]
        kk = torch.randn(ctx + n, num_kv_heads, head_dim, generator=g).to(dtype)  # [L, Hkv, D]
        vv = torch.randn(ctx + n, num_kv_heads, head_dim, generator=g).to(dtype)
        torch_ref.write_kv(
            kk[:ctx], vv[:ctx], cache, torch.tensor(pos_slots[:ctx], dtype=torch.int64)
        )
        full_k.append(kk)
        full_v.append(vv)
        ks.append(kk[ctx:])
        vs.append(vv[ctx:])
        qs.append(torch.randn(n, num_heads, head_dim, generator=g).to(dtype))
        slots += pos_slots[ctx:]
        qsl.append(qsl[-1] + n)
        seq_lens.append(ctx + n)
    meta = AttentionMetadata.build(
        slot_mapping=np.array(slots, dtype=np.int32),
        query_start_loc=np.array(qsl, dtype=np.int32),
        seq_lens=np.array(seq_lens, dtype=np.int32),
        block_tables=block_tables,
        device="cpu",
    )
    return torch.cat(qs), torch.cat(ks), torch.cat(vs), cache, meta, full_k, full_v


def naive_attention(q, full_k, full_v, seqs, scale, sliding_window=None, softcap=None):
    """Per sequence, float64, K/V heads repeated for GQA."""
    outs, t = [], 0
    for (ctx, n), kk, vv in zip(seqs, full_k, full_v):
        qq = q[t : t + n].double()  # [n, H, D]
        t += n
        groups = qq.shape[1] // kk.shape[1]
        kk = kk.double().repeat_interleave(groups, dim=1)  # [L, H, D]
        vv = vv.double().repeat_interleave(groups, dim=1)
        s = torch.einsum("qhd,khd->hqk", qq, kk) * scale  # [H, n, L]
        if softcap:
            s = torch.tanh(s / softcap) * softcap
        qpos = torch.arange(ctx, ctx + n)[:, None]
        kpos = torch.arange(ctx + n)[None, :]
        visible = kpos <= qpos
        if sliding_window:
            visible &= kpos > qpos - sliding_window
        s = s.masked_fill(~visible, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), vv))
    return torch.cat(outs)


def run_case(seqs, block_size, num_heads=4, num_kv_heads=2, head_dim=16, seed=0, **opts):
    q, k, v, cache, meta, fk, fv = make_batch(
        seqs, block_size, num_kv_heads, head_dim, num_heads, seed
    )
    scale = 1 / math.sqrt(head_dim)
    out = torch_ref.forward(q, k, v, cache, meta, AttentionParams(scale, **opts))
    ref = naive_attention(q, fk, fv, seqs, scale, **opts)
    assert out.shape == q.shape
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    return meta


MIXED = [(9, 1), (0, 1), (30, 1), (0, 13), (7, 5), (21, 1), (0, 2)]  # decodes first, then mixed


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("heads", [(4, 2), (4, 4), (8, 1)])
def test_mixed_batch_matches_naive(block_size, heads):
    meta = run_case(MIXED, block_size, num_heads=heads[0], num_kv_heads=heads[1])
    assert meta.num_decodes == 3  # the decode tail (21, 1) goes through the padded path


def test_prefill_only_and_decode_only():
    run_case([(0, 17), (0, 3), (0, 32)], 4, seed=1)
    meta = run_case([(5, 1), (16, 1), (0, 1), (40, 1)], 16, seed=2)
    assert meta.num_decodes == meta.num_seqs == 4


def test_chunked_prefill_continuation():
    run_case([(16, 16), (3, 29)], 4, seed=3)


@pytest.mark.parametrize(
    "opts", [{"sliding_window": 5}, {"softcap": 2.0}, {"sliding_window": 3, "softcap": 5.0}]
)
def test_sliding_window_and_softcap(opts):
    run_case(MIXED, 4, seed=4, **opts)


def test_small_budget_forces_groups_and_query_chunks(monkeypatch):
    monkeypatch.setattr(torch_ref, "MAX_ELEMS", 4000)
    run_case(MIXED + [(10, 20), (0, 1)], 4, seed=5)
    run_case([(0, 1), (3, 1), (9, 1)], 4, seed=6)


def test_padding_tokens_are_ignored():
    seqs = [(3, 1), (0, 6)]
    q, k, v, cache, meta, fk, fv = make_batch(seqs, 4, 2, 16, 4, seed=7)
    pad = 3
    padded = AttentionMetadata.build(
        slot_mapping=np.concatenate([meta.slot_mapping.numpy(), np.full(pad, -1)]),
        query_start_loc=meta.query_start_loc_cpu,
        seq_lens=meta.seq_lens_cpu,
        block_tables=meta.block_tables.numpy(),
        device="cpu",
    )
    extra = lambda x: torch.cat([x, torch.randn(pad, *x.shape[1:])])  # noqa: E731
    out = torch_ref.forward(extra(q), extra(k), extra(v), cache, padded, AttentionParams(0.25))
    assert torch.all(out[-pad:] == 0)
    torch.testing.assert_close(
        out[:-pad].double(), naive_attention(q, fk, fv, seqs, 0.25), atol=1e-5, rtol=1e-5
    )


def test_bf16_close_to_float64():
    seqs = [(9, 1), (0, 12)]
    q, k, v, cache, meta, fk, fv = make_batch(seqs, 4, 2, 16, 4, seed=8, dtype=torch.bfloat16)
    out = torch_ref.forward(q, k, v, cache, meta, AttentionParams(0.25))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(
        out.double(), naive_attention(q, fk, fv, seqs, 0.25), atol=2e-2, rtol=2e-2
    )


def test_metadata_build_derives_split_and_checks_shapes():
    meta = AttentionMetadata.build(
        slot_mapping=np.arange(7),
        query_start_loc=np.array([0, 1, 2, 7]),
        seq_lens=np.array([4, 9, 5]),
        block_tables=np.array([[0, -1], [1, 2], [3, 4]]),
        device="cpu",
    )
    assert (meta.num_decodes, meta.num_tokens, meta.max_query_len, meta.max_seq_len) == (2, 7, 5, 9)
    assert (meta.decode_max_seq_len, meta.prefill_max_seq_len, meta.prefill_max_query_len) == (
        9,
        5,
        5,
    )
    assert meta.slot_mapping.dtype == torch.int64 and meta.block_tables.dtype == torch.int32
    assert meta.block_tables.min() >= 0
    with pytest.raises(ValueError):
        AttentionMetadata.build(
            slot_mapping=np.arange(3),
            query_start_loc=np.array([0, 5]),
            seq_lens=np.array([5]),
            block_tables=np.array([[0, 1]]),
            device="cpu",
        )
    with pytest.raises(ValueError):
        AttentionMetadata.build(
            slot_mapping=np.arange(5),
            query_start_loc=np.array([0, 5]),
            seq_lens=np.array([4]),
            block_tables=np.array([[0, 1]]),
            device="cpu",
        )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("opts", [{}, {"sliding_window": 4, "softcap": 3.0}])
def test_cuda_matches_naive(opts):
    q, k, v, cache, meta, fk, fv = make_batch(MIXED, 4, 2, 16, 4, seed=9)
    m = meta
    cuda_meta = AttentionMetadata.build(
        slot_mapping=m.slot_mapping.numpy(),
        query_start_loc=m.query_start_loc_cpu,
        seq_lens=m.seq_lens_cpu,
        block_tables=m.block_tables.numpy(),
        device="cuda",
    )
    out = torch_ref.forward(
        q.cuda(), k.cuda(), v.cuda(), KVCache(cache.k.cuda(), cache.v.cuda()), cuda_meta,
        AttentionParams(0.25, **opts),
    )
    ref = naive_attention(q, fk, fv, MIXED, 0.25, **opts)
    torch.testing.assert_close(out.cpu().double(), ref, atol=1e-4, rtol=1e-4)

"""Parallel linears: tp_size 1 against nn.functional, and simulated TP ranks (one process,
parallel_state patched per rank, collectives done by hand) against the unsharded result."""

import pytest
import torch
import torch.nn.functional as F

from cvllm.distributed import parallel_state
from cvllm.distributed.parallel_state import GroupCoordinator
from cvllm.layers import embedding as embedding_mod
from cvllm.layers import linear as linear_mod
from cvllm.layers.embedding import LogitsProcessor, ParallelLMHead, VocabParallelEmbedding
from cvllm.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)


@pytest.fixture
def as_rank(monkeypatch):
    """``as_rank(rank, size)`` makes layers built afterwards believe they are that TP rank."""
    monkeypatch.setattr(linear_mod, "tensor_model_parallel_all_reduce", lambda x: x)
    monkeypatch.setattr(embedding_mod, "tensor_model_parallel_all_reduce", lambda x: x)

    def set_rank(rank, size):
        monkeypatch.setattr(
            parallel_state, "_TP", GroupCoordinator(rank_in_group=rank, world_size=size)
        )

    return set_rank


def load(layer, **named):
    for pname, pieces in named.items():
        param = getattr(layer, pname)
        for shard_id, tensor in pieces:
            if shard_id is None:
                param.weight_loader(param, tensor)
            else:
                param.weight_loader(param, tensor, shard_id)


def test_replicated_and_tp1_layers_match_functional():
    w, b, x = torch.randn(6, 5), torch.randn(6), torch.randn(3, 5)
    for cls in (ReplicatedLinear, ColumnParallelLinear, RowParallelLinear):
        layer = cls(5, 6, bias=True, params_dtype=torch.float32)
        load(layer, weight=[(None, w)], bias=[(None, b)])
        torch.testing.assert_close(layer(x), F.linear(x, w, b))
    with pytest.raises(ValueError, match="shape mismatch"):
        load(ReplicatedLinear(5, 6, params_dtype=torch.float32), weight=[(None, torch.randn(6, 4))])


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_column_and_row_sharding(as_rank, tp):
    w1, b1, w2, b2 = torch.randn(8, 6), torch.randn(8), torch.randn(6, 8), torch.randn(6)
    x = torch.randn(3, 6)
    full_h = F.linear(x, w1, b1)
    hs, ys = [], []
    for r in range(tp):
        as_rank(r, tp)
        col, row = ColumnParallelLinear(6, 8, params_dtype=torch.float32), RowParallelLinear(
            8, 6, params_dtype=torch.float32
        )
        load(col, weight=[(None, w1)], bias=[(None, b1)])
        load(row, weight=[(None, w2)], bias=[(None, b2)])
        h = col(x)  # [3, 8 / tp]
        hs.append(h)
        ys.append(row(h))  # partial sums; bias only on rank 0
    torch.testing.assert_close(torch.cat(hs, -1), full_h)
    torch.testing.assert_close(sum(ys), F.linear(full_h, w2, b2))


@pytest.mark.parametrize("tp", [1, 2])
def test_merged_column(as_rank, tp):
    gate, up, bg, bu = torch.randn(4, 6), torch.randn(4, 6), torch.randn(4), torch.randn(4)
    x = torch.randn(2, 6)
    for r in range(tp):
        as_rank(r, tp)
        layer = MergedColumnParallelLinear(6, [4, 4], bias=True, params_dtype=torch.float32)
        load(layer, weight=[(0, gate), (1, up)], bias=[(0, bg), (1, bu)])
        g_out, u_out = layer(x).chunk(2, dim=-1)
        n = 4 // tp
        torch.testing.assert_close(g_out, F.linear(x, gate, bg)[:, r * n : (r + 1) * n])
        torch.testing.assert_close(u_out, F.linear(x, up, bu)[:, r * n : (r + 1) * n])
        fused = MergedColumnParallelLinear(6, [4, 4], bias=False, params_dtype=torch.float32)
        load(fused, weight=[(None, torch.cat([gate, up]))])  # a pre-fused checkpoint tensor
        torch.testing.assert_close(fused.weight, layer.weight)


@pytest.mark.parametrize("heads,kv_heads,tp,want_kv", [
    (4, 2, 1, [[0, 1]]),
    (4, 2, 2, [[0], [1]]),
    (4, 2, 4, [[0], [0], [1], [1]]),  # replicated: rank r uses r * Hkv // tp
    (8, 4, 2, [[0, 1], [2, 3]]),
    (6, 3, 3, [[0], [1], [2]]),  # not a power of two
    (6, 2, 6, [[0], [0], [0], [1], [1], [1]]),
    (6, 2, 3, [[0, 0], [0, 1], [1, 1]]),  # rank 1's two query heads use different KV heads
    (12, 4, 6, [[0, 0], [0, 1], [1, 1], [2, 2], [2, 3], [3, 3]]),
])
def test_qkv_sharding_with_kv_replication(as_rank, heads, kv_heads, tp, want_kv):
    d, hidden = 3, 5
    wq, wk, wv = (
        torch.randn(heads * d, hidden),
        torch.randn(kv_heads * d, hidden),
        torch.randn(kv_heads * d, hidden),
    )
    x = torch.randn(2, hidden)
    q_full, k_full, v_full = F.linear(x, wq), F.linear(x, wk), F.linear(x, wv)
    group = heads // kv_heads
    for r in range(tp):
        as_rank(r, tp)
        layer = QKVParallelLinear(
            hidden, d, heads, kv_heads, bias=False, params_dtype=torch.float32
        )
        load(layer, weight=[("q", wq), ("k", wk), ("v", wv)])
        nh, nkv = layer.num_heads, layer.num_kv_heads
        assert nh == heads // tp and layer.kv_head_ids == want_kv[r]
        q, k, v = layer(x).split([nh * d, nkv * d, nkv * d], dim=-1)
        torch.testing.assert_close(q, q_full[:, r * nh * d : (r + 1) * nh * d])
        for j, head in enumerate(layer.kv_head_ids):
            mine, theirs = slice(j * d, (j + 1) * d), slice(head * d, (head + 1) * d)
            torch.testing.assert_close(k[:, mine], k_full[:, theirs])
            torch.testing.assert_close(v[:, mine], v_full[:, theirs])
        # Attention's uniform grouping (local q head i -> local kv i // (nh / nkv)) gives
        # every query head the KV head it has in the full model.
        for i in range(nh):
            assert layer.kv_head_ids[i // (nh // nkv)] == (r * nh + i) // group
        fused = QKVParallelLinear(
            hidden, d, heads, kv_heads, bias=False, params_dtype=torch.float32
        )
        load(fused, weight=[(None, torch.cat([wq, wk, wv]))])
        torch.testing.assert_close(fused.weight, layer.weight)


@pytest.mark.parametrize("heads,kv_heads,tp,want_q,want_kv", [
    (9, 3, 2, [[0, 1, 2, 3, 3], [4, 5, 6, 7, 8]], [[0, 0, 0, 1, 1], [1, 1, 2, 2, 2]]),  # SmolLM2
    (9, 3, 4, [[0, 1, 1], [2, 3, 3], [4, 5, 5], [6, 7, 8]],
     [[0, 0, 0], [0, 1, 1], [1, 1, 1], [2, 2, 2]]),
    (6, 6, 4, [[0, 0], [1, 2], [3, 3], [4, 5]], [[0, 0], [1, 2], [3, 3], [4, 5]]),  # MHA
])
def test_qkv_and_o_proj_uneven_head_split(as_rank, heads, kv_heads, tp, want_q, want_kv):
    """tp not dividing the heads: balanced ranges padded to one slot count; the shards
    reassemble the full q/k/v, and the o_proj partial sums (padding columns zero) add up
    to the full ``o_proj(q_proj(x))``."""
    d, hidden = 3, 5
    wq, wk, wv = (torch.randn(heads * d, hidden), torch.randn(kv_heads * d, hidden),
                  torch.randn(kv_heads * d, hidden))
    wo, bo = torch.randn(hidden, heads * d), torch.randn(hidden)
    x = torch.randn(2, hidden)
    q_full, k_full, v_full = F.linear(x, wq), F.linear(x, wk), F.linear(x, wv)
    group, total, seen = heads // kv_heads, torch.zeros(2, hidden), []
    for r in range(tp):
        as_rank(r, tp)
        qkv = QKVParallelLinear(hidden, d, heads, kv_heads, bias=False,
                                params_dtype=torch.float32)
        load(qkv, weight=[("q", wq), ("k", wk), ("v", wv)])
        nh, nkv = qkv.num_heads, qkv.num_kv_heads
        assert (qkv.q_head_ids, qkv.kv_head_ids) == (want_q[r], want_kv[r])
        q, k, v = qkv(x).split([nh * d, nkv * d, nkv * d], dim=-1)
        for i, head in enumerate(qkv.q_head_ids):  # pads repeat the rank's last head
            torch.testing.assert_close(q[:, i * d:(i + 1) * d], q_full[:, head * d:(head + 1) * d])
            assert qkv.kv_head_ids[i // (nh // nkv)] == head // group  # uniform grouping
        for j, head in enumerate(qkv.kv_head_ids):
            torch.testing.assert_close(k[:, j * d:(j + 1) * d], k_full[:, head * d:(head + 1) * d])
            torch.testing.assert_close(v[:, j * d:(j + 1) * d], v_full[:, head * d:(head + 1) * d])
        seen += qkv.q_head_ids[:qkv.num_real_heads]
        o_proj = RowParallelLinear(heads * d, hidden, bias=True, params_dtype=torch.float32,
                                   input_blocks=qkv.o_proj_input_blocks, block_size=d)
        load(o_proj, weight=[(None, wo)], bias=[(None, bo)])
        assert o_proj.weight.shape == (hidden, nh * d)
        total += o_proj(q)
        fused = QKVParallelLinear(hidden, d, heads, kv_heads, bias=False,
                                  params_dtype=torch.float32)
        load(fused, weight=[(None, torch.cat([wq, wk, wv]))])
        torch.testing.assert_close(fused.weight, qkv.weight)
    assert seen == list(range(heads))  # every head on exactly one rank
    torch.testing.assert_close(total, F.linear(q_full, wo, bo))


def test_even_split_keeps_the_plain_row_partition(as_rank):
    as_rank(1, 3)
    qkv = QKVParallelLinear(5, 3, 9, 3, bias=False, params_dtype=torch.float32)
    assert qkv.o_proj_input_blocks is None and qkv.q_head_ids == [3, 4, 5]


def test_qkv_rejects_more_ranks_than_heads(as_rank):
    as_rank(0, 8)
    with pytest.raises(ValueError, match="6 attention heads cannot be split over 8 ranks"):
        QKVParallelLinear(5, 3, 6, 2, bias=False, params_dtype=torch.float32)


@pytest.mark.parametrize("tp", [1, 2])
def test_vocab_parallel_embedding_and_lm_head(as_rank, tp):
    vocab, dim = 100, 8  # padded to 128 (tp 1) / 256 (tp 2)
    emb_w = torch.randn(vocab, dim)
    ids = torch.tensor([0, 5, 63, 64, 99])
    h = torch.randn(3, dim)
    embs, logits = [], []
    for r in range(tp):
        as_rank(r, tp)
        emb = VocabParallelEmbedding(vocab, dim, torch.float32)
        load(emb, weight=[(None, emb_w)])
        embs.append(emb(ids))
        head = ParallelLMHead(vocab, dim, params_dtype=torch.float32).tie_weights(emb)
        assert head.weight is emb.weight
        logits.append(F.linear(h, head.weight))  # [3, V_per_partition]
    torch.testing.assert_close(sum(embs), emb_w[ids])
    torch.testing.assert_close(torch.cat(logits, -1)[:, :vocab], F.linear(h, emb_w))
    if tp == 1:
        out = LogitsProcessor(vocab)(head, h)
        assert out.shape == (3, vocab) and out.dtype == torch.float32
        torch.testing.assert_close(out, F.linear(h, emb_w))


def _recording_lazy(full, log):
    """``full`` as a LazyTensor whose reads are logged as ``(row start, rows)``."""
    from cvllm.loader.lazy import LazyTensor

    def read(ranges):
        log.append(ranges[0])
        out = full
        for dim, (s, n) in enumerate(ranges):
            out = out.narrow(dim, s, n)
        return out.clone()

    return LazyTensor("w", full.shape, full.dtype, read)


def test_loaders_read_only_their_rows_of_lazy_tensors(as_rank):
    """Each layer narrows before it reads: rank 1 of 3 over 6 query / 2 KV heads reads
    query rows [2D, 4D) and KV heads 0 and 1 (a run of both), nothing else."""
    heads, kv_heads, d, hidden = 6, 2, 3, 5
    wq, wk = torch.randn(heads * d, hidden), torch.randn(kv_heads * d, hidden)
    as_rank(1, 3)
    layer = QKVParallelLinear(hidden, d, heads, kv_heads, bias=False, params_dtype=torch.float32)
    log = []
    layer.weight_loader(layer.weight, _recording_lazy(wq, log), "q")
    layer.weight_loader(layer.weight, _recording_lazy(wk, log), "k")
    assert log == [(2 * d, 2 * d), (0, 2 * d)]
    emb = VocabParallelEmbedding(100, 8, torch.float32)  # rows [64, 100) of 3 x 64 padded
    log = []
    emb.weight_loader(emb.weight, _recording_lazy(torch.randn(100, 8), log))
    assert log == [(64, 36)]
    as_rank(2, 3)
    tail = VocabParallelEmbedding(100, 8, torch.float32)  # all padding: reads nothing
    log = []
    tail.weight_loader(tail.weight, _recording_lazy(torch.randn(100, 8), log))
    assert log == [] and not tail.weight.any()

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


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_qkv_sharding_with_kv_replication(as_rank, tp):
    heads, kv_heads, d, hidden = 4, 2, 3, 5
    wq, wk, wv = (
        torch.randn(heads * d, hidden),
        torch.randn(kv_heads * d, hidden),
        torch.randn(kv_heads * d, hidden),
    )
    x = torch.randn(2, hidden)
    q_full, k_full, v_full = F.linear(x, wq), F.linear(x, wk), F.linear(x, wv)
    for r in range(tp):
        as_rank(r, tp)
        layer = QKVParallelLinear(
            hidden, d, heads, kv_heads, bias=False, params_dtype=torch.float32
        )
        load(layer, weight=[("q", wq), ("k", wk), ("v", wv)])
        nh, nkv = layer.num_heads, layer.num_kv_heads
        assert nh == heads // tp and nkv == max(1, kv_heads // tp)
        q, k, v = layer(x).split([nh * d, nkv * d, nkv * d], dim=-1)
        kv_rank = r // layer.num_kv_head_replicas
        torch.testing.assert_close(q, q_full[:, r * nh * d : (r + 1) * nh * d])
        torch.testing.assert_close(k, k_full[:, kv_rank * nkv * d : (kv_rank + 1) * nkv * d])
        torch.testing.assert_close(v, v_full[:, kv_rank * nkv * d : (kv_rank + 1) * nkv * d])
        fused = QKVParallelLinear(
            hidden, d, heads, kv_heads, bias=False, params_dtype=torch.float32
        )
        load(fused, weight=[(None, torch.cat([wq, wk, wv]))])
        torch.testing.assert_close(fused.weight, layer.weight)


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

"""GGUF-typed parallel layers: packed weights sharded by whole blocks (simulated TP ranks),
mixed part types in a fused layer, embeddings / tied heads, MoE experts, and the split
refusal. The oracle is the reference dequantizer + a float32 matmul, and the layers use the
reference backend (tolerance: float32 summation order, 1e-4 relative)."""

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from cvllm.distributed import parallel_state
from cvllm.distributed.parallel_state import GroupCoordinator
from cvllm.kernels.quant.ggml_types import GgmlType
from cvllm.kernels.quant.reference import dequantize
from cvllm.layers import embedding as embedding_mod
from cvllm.layers import linear as linear_mod
from cvllm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from cvllm.layers.linear import (
    MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear,
)
from cvllm.loader.lazy import LazyTensor
from cvllm.models.utils import process_weights_after_loading
from cvllm.quantization.gguf import GGUFQuantConfig
from cvllm.quantization.gguf_methods import GGUFEmbeddingMethod, GGUFLinearMethod
from cvllm.quantization.packed import BlockSplitError
from tests.layers.test_linear import load


@pytest.fixture(autouse=True)
def reference_kernels(monkeypatch):
    """The layers' sharding is under test here, not the kernels (tests/kernels/): every
    weight goes to the exact torch reference backend."""
    from cvllm.kernels.quant.backend import ReferenceBackend
    from cvllm.quantization import gguf_methods

    monkeypatch.setattr(gguf_methods, "backend_for", lambda device, t, dtype: ReferenceBackend())


@pytest.fixture
def as_rank(monkeypatch):
    monkeypatch.setattr(linear_mod, "tensor_model_parallel_all_reduce", lambda x: x)
    monkeypatch.setattr(embedding_mod, "tensor_model_parallel_all_reduce", lambda x: x)

    def set_rank(rank, size):
        monkeypatch.setattr(parallel_state, "_TP", GroupCoordinator(rank_in_group=rank,
                                                                    world_size=size))
    return set_rank


def gguf_tensor(w: torch.Tensor, t: GgmlType, name="w"):
    """A lazy GGUF-like tensor of ``w`` quantized by gguf-py: (lazy, dequantized floats)."""
    raw = torch.from_numpy(gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType(t)))

    def read_raw(ranges):
        (r0, n), (c0, k) = ranges
        elems, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(t)]
        return raw[r0:r0 + n, c0 // elems * nbytes:(c0 + k) // elems * nbytes].clone()

    def read(ranges):
        return dequantize(read_raw(ranges), t)

    return LazyTensor(name, w.shape, torch.float32, read, ggml_type=int(t), read_raw=read_raw), \
        dequantize(raw, t)


def _config(types):
    return GGUFQuantConfig(tensor_types=types, stacked_params_mapping=[
        (".qkv_proj", ".q_proj", "q"), (".qkv_proj", ".k_proj", "k"),
        (".qkv_proj", ".v_proj", "v"), (".gate_up_proj", ".gate_proj", 0),
        (".gate_up_proj", ".up_proj", 1)])


@pytest.mark.parametrize("tp", [1, 2])
def test_row_parallel_shards_whole_blocks(as_rank, tp):
    torch.manual_seed(0)
    w = torch.randn(16, 128)
    lazy, wd = gguf_tensor(w, GgmlType.Q4_0)
    x = torch.randn(3, 128)
    cfg = _config({"o.weight": int(GgmlType.Q4_0)})
    total = 0
    for rank in range(tp):
        as_rank(rank, tp)
        layer = RowParallelLinear(128, 16, bias=False, params_dtype=torch.float32,
                                  quant_config=cfg, prefix="o", reduce_results=False)
        assert isinstance(layer.quant_method, GGUFLinearMethod)
        load(layer, weight=[(None, lazy)])
        process_weights_after_loading(layer)
        xs = x.chunk(tp, -1)[rank]
        total = total + layer(xs)
    torch.testing.assert_close(total, F.linear(x, wd), rtol=1e-4, atol=1e-4)


def test_row_split_that_cuts_a_block_is_refused(as_rank):
    as_rank(0, 2)
    cfg = _config({"o.weight": int(GgmlType.Q8_0)})
    with pytest.raises(BlockSplitError, match=r"o: 96 input features over 2 ranks .* blocks "
                                              r"of 32; rank counts that work: \[1, 3\]"):
        RowParallelLinear(96, 8, bias=False, params_dtype=torch.float32, quant_config=cfg,
                          prefix="o")


@pytest.mark.parametrize("tp", [1, 2])
def test_qkv_with_mixed_part_types(as_rank, tp):
    """q and k in Q4_0, v in Q8_0 (as Q4_K_M mixes types): one layer, two runs of rows."""
    torch.manual_seed(1)
    H, Hkv, D, hidden = 4, 2, 32, 64
    wq, wk, wv = torch.randn(H * D, hidden), torch.randn(Hkv * D, hidden), torch.randn(
        Hkv * D, hidden)
    (lq, dq), (lk, dk), (lv, dv) = (gguf_tensor(wq, GgmlType.Q4_0), gguf_tensor(wk, GgmlType.Q4_0),
                                    gguf_tensor(wv, GgmlType.Q8_0))
    cfg = _config({"a.q_proj.weight": 2, "a.k_proj.weight": 2, "a.v_proj.weight": 8})
    x = torch.randn(5, hidden)
    for rank in range(tp):
        as_rank(rank, tp)
        layer = QKVParallelLinear(hidden, D, H, Hkv, bias=False, params_dtype=torch.float32,
                                  quant_config=cfg, prefix="a.qkv_proj")
        assert layer.quant_method.part_types == [GgmlType.Q4_0, GgmlType.Q4_0, GgmlType.Q8_0]
        load(layer, weight=[("q", lq), ("k", lk), ("v", lv)])
        process_weights_after_loading(layer)
        assert len(layer.quant_method.prepared.groups) == 2
        hq, hk = H // tp, Hkv // tp
        want = torch.cat([dq[rank * hq * D:(rank + 1) * hq * D],
                          dk[rank * hk * D:(rank + 1) * hk * D],
                          dv[rank * hk * D:(rank + 1) * hk * D]])
        torch.testing.assert_close(layer(x), F.linear(x, want), rtol=1e-4, atol=1e-4)


def test_merged_gate_up_float_fallback_is_quantized_on_load(as_rank):
    """A plain float tensor loaded into a quantized part is quantized there (the --isq
    path): the result equals quantizing it with the same type."""
    as_rank(0, 1)
    torch.manual_seed(2)
    g, u = torch.randn(32, 64), torch.randn(32, 64)
    cfg = GGUFQuantConfig(isq="q8_0", stacked_params_mapping=[])
    layer = MergedColumnParallelLinear(64, [32, 32], bias=False, params_dtype=torch.float32,
                                       quant_config=cfg, prefix="m.gate_up_proj")
    load(layer, weight=[(0, g), (1, u)])
    process_weights_after_loading(layer)
    _, gd = gguf_tensor(g, GgmlType.Q8_0)
    _, ud = gguf_tensor(u, GgmlType.Q8_0)
    x = torch.randn(2, 64)
    torch.testing.assert_close(layer(x), F.linear(x, torch.cat([gd, ud])), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("tp", [1, 2])
def test_quantized_embedding_and_tied_head(as_rank, tp):
    torch.manual_seed(3)
    V, dim = 100, 64
    w = torch.randn(V, dim)
    lazy, wd = gguf_tensor(w, GgmlType.Q8_0)
    cfg = _config({"embed.weight": int(GgmlType.Q8_0)})
    ids = torch.tensor([0, 5, 99, 42])
    x = torch.randn(2, dim)
    emb_sum, logits = 0, []
    for rank in range(tp):
        as_rank(rank, tp)
        emb = VocabParallelEmbedding(V, dim, torch.float32, prefix="embed", quant_config=cfg)
        assert isinstance(emb.quant_method, GGUFEmbeddingMethod)
        head = ParallelLMHead(V, dim, params_dtype=torch.float32, prefix="head",
                              quant_config=cfg).tie_weights(emb)
        load(emb, weight=[(None, lazy)])
        for m in (emb, head):
            m.quant_method.process_weights_after_loading(m)
        emb_sum = emb_sum + emb(ids)
        logits.append(head.quant_method.apply(head, x))
    torch.testing.assert_close(emb_sum, wd[ids], rtol=0, atol=0)
    full = torch.cat(logits, -1)[:, :V]
    torch.testing.assert_close(full, F.linear(x, wd), rtol=1e-4, atol=1e-4)
    assert torch.count_nonzero(torch.cat(logits, -1)[:, V:]) == 0  # padding rows are zero


def test_moe_experts_quantized(as_rank):
    from cvllm.kernels.reference.fused_moe import fused_moe_ref
    from cvllm.layers.moe import FusedMoE

    as_rank(0, 1)
    torch.manual_seed(4)
    E, H, inter = 4, 64, 32
    gate, up, down = torch.randn(E, inter, H), torch.randn(E, inter, H), torch.randn(E, H, inter)
    types = {"mlp.experts.gate_proj.weight": 2, "mlp.experts.up_proj.weight": 2,
             "mlp.experts.down_proj.weight": 8}
    moe = FusedMoE(E, 2, H, inter, torch.float32, prefix="mlp.experts",
                   quant_config=_config(types))
    deq = {}
    for name, w, t, sid in (("gate", gate, GgmlType.Q4_0, "w1"), ("up", up, GgmlType.Q4_0, "w3"),
                            ("down", down, GgmlType.Q8_0, "w2")):
        lazies = [gguf_tensor(w[e], t) for e in range(E)]
        deq[name] = torch.stack([d for _, d in lazies])
        param = moe.w2_weight if sid == "w2" else moe.w13_weight
        for e, (lz, _) in enumerate(lazies):
            param.weight_loader(param, lz, e, sid)
    hidden = torch.randn(6, H)
    topk_w = torch.rand(6, 2)
    topk_ids = torch.randint(0, E, (6, 2))
    got = moe(hidden, topk_w, topk_ids)
    want = fused_moe_ref(hidden, torch.cat([deq["gate"], deq["up"]], 1), deq["down"], topk_w,
                         topk_ids)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)


def test_block_slice_of_raw_rows_matches_gguf_dequantize():
    """The lazy raw read of a row/column block range is the same bytes gguf-py sees."""
    torch.manual_seed(5)
    w = torch.randn(8, 256)
    lazy, wd = gguf_tensor(w, GgmlType.Q4_1)
    part = lazy.narrow(0, 2, 4).narrow(1, 64, 128)
    np.testing.assert_array_equal(dequantize(part.read_raw(), GgmlType.Q4_1).numpy(),
                                  wd[2:6, 64:192].numpy())

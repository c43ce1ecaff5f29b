"""MoE layer: routing against transformers' routers, weight loading (per expert, stacked,
fused, TP-sharded) and the FusedMoE forward against a per-token loop."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cvllm.distributed import parallel_state
from cvllm.layers.moe import (FusedMoE, expert_params_mapping, parse_expert_weight_name,
                              select_experts)

T, E, H, I = 11, 8, 16, 12


def _same_routing(ours, theirs):
    """Same experts and weights per token, in any order within the token's top-k."""
    (w, ids), (tw, tids) = ours, theirs
    order, torder = ids.argsort(-1), tids.argsort(-1)
    assert torch.equal(ids.gather(1, order), tids.long().gather(1, torder))
    torch.testing.assert_close(w.gather(1, order), tw.float().gather(1, torder), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("norm", [False, True])
def test_softmax_routing_matches_qwen2_moe(norm):
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter

    cfg = Qwen2MoeConfig(hidden_size=H, num_experts=E, num_experts_per_tok=2, norm_topk_prob=norm)
    router = Qwen2MoeTopKRouter(cfg)
    torch.nn.init.normal_(router.weight)
    x = torch.randn(T, H)
    _, tw, tids = router(x)
    _same_routing(select_experts(F.linear(x, router.weight), 2, renormalize=norm), (tw, tids))


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy"])
def test_deepseek_v2_routing(method):
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    cfg = DeepseekV2Config(hidden_size=H, num_attention_heads=2, n_routed_experts=E, num_experts_per_tok=3, n_group=4,
                           topk_group=2, topk_method=method, routed_scaling_factor=1.5)
    router = DeepseekV2TopkRouter(cfg)
    torch.nn.init.normal_(router.weight)
    x = torch.randn(T, H)
    logits, tw, tids = router(x)
    groups = (4, 2) if method == "group_limited_greedy" else (None, None)
    ours = select_experts(logits, 3, renormalize=False, num_expert_group=groups[0],
                          topk_group=groups[1], routed_scaling_factor=1.5)
    _same_routing(ours, (tw, tids))


def test_deepseek_v3_noaux_tc_routing():
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = DeepseekV3Config(hidden_size=H, num_attention_heads=2, n_routed_experts=E, num_experts_per_tok=3, n_group=4,
                           topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5)
    router = DeepseekV3TopkRouter(cfg)
    torch.nn.init.normal_(router.weight)
    router.e_score_correction_bias.normal_(0, 0.5)  # large enough to change the choice
    x = torch.randn(T, H)
    logits, tw, tids = router(x)
    ours = select_experts(logits, 3, True, "sigmoid", router.e_score_correction_bias, 4, 2, 2.5)
    _same_routing(ours, (tw, tids))
    plain = select_experts(logits, 3, True, "sigmoid", None, 4, 2, 2.5)
    assert not torch.equal(plain[1].sort(-1)[0], ours[1].sort(-1)[0]), "bias must matter"


def test_select_experts_rejects_bad_settings():
    logits = torch.randn(T, E)
    with pytest.raises(ValueError, match="top_k"):
        select_experts(logits, E + 1, False)
    with pytest.raises(ValueError, match="scoring_func"):
        select_experts(logits, 2, False, scoring_func="relu")
    with pytest.raises(ValueError, match="kept groups"):
        select_experts(logits, 3, False, num_expert_group=4, topk_group=1)


def _experts(seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(E, I, H, generator=g), torch.randn(E, I, H, generator=g),
            torch.randn(E, H, I, generator=g))  # gate, up, down


def _per_token(x, gate, up, down, w, ids):
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = ids[t, k]
            out[t] += w[t, k] * (down[e] @ (F.silu(gate[e] @ x[t]) * (up[e] @ x[t])))
    return out


def test_fused_moe_loaders_and_forward():
    gate, up, down = _experts()
    per_expert, stacked = FusedMoE(E, 2, H, I, torch.float32), FusedMoE(E, 2, H, I, torch.float32)
    for e in range(E):
        for w, shard in ((gate[e], "w1"), (up[e], "w3")):
            per_expert.weight_loader(per_expert.w13_weight, w, e, shard)
        per_expert.weight_loader(per_expert.w2_weight, down[e], e, "w2")
    stacked.load_stacked(stacked.w13_weight, torch.cat([gate, up], dim=1), "w13")
    stacked.load_stacked(stacked.w2_weight, down, "w2")
    assert torch.equal(per_expert.w13_weight, stacked.w13_weight)
    assert torch.equal(per_expert.w2_weight, stacked.w2_weight)
    x = torch.randn(T, H)
    w, ids = select_experts(torch.randn(T, E), 2, True)
    torch.testing.assert_close(per_expert(x, w, ids), _per_token(x, gate, up, down, w, ids),
                               atol=1e-3, rtol=1e-4)
    with pytest.raises(ValueError, match="does not fit"):
        per_expert.weight_loader(per_expert.w2_weight, down[0], 0, "w1")
    with pytest.raises(ValueError, match="shape mismatch"):
        per_expert.weight_loader(per_expert.w13_weight, gate[0].t(), 0, "w1")


def test_tensor_parallel_shards_sum_to_the_full_layer(monkeypatch):
    """Each of 2 ranks holds half of every expert's intermediate dim; the (all-reduce) sum
    of their outputs is the full layer's."""
    gate, up, down = _experts(1)
    x = torch.randn(T, H)
    w, ids = select_experts(torch.randn(T, E), 2, False)
    partial = []
    for rank in range(2):
        monkeypatch.setattr(parallel_state, "_TP", parallel_state.GroupCoordinator(rank, 2))
        layer = FusedMoE(E, 2, H, I, torch.float32, reduce_results=False)
        assert layer.w13_weight.shape == (E, I, H) and layer.w2_weight.shape == (E, H, I // 2)
        for e in range(E):
            layer.weight_loader(layer.w13_weight, gate[e], e, "w1")
            layer.weight_loader(layer.w13_weight, up[e], e, "w3")
        layer.load_stacked(layer.w2_weight, down, "w2")
        partial.append(layer(x, w, ids))
    torch.testing.assert_close(partial[0] + partial[1], _per_token(x, gate, up, down, w, ids),
                               atol=1e-3, rtol=1e-4)


def test_expert_weight_names():
    mapping = expert_params_mapping(2)
    assert ("experts.w13_weight", "experts.1.up_proj.weight", 1, "w3") in mapping
    assert len(mapping) == 6
    assert parse_expert_weight_name("model.layers.3.mlp.experts.5.down_proj.weight") == (
        "model.layers.3.mlp.experts.w2_weight", 5, "w2")
    assert parse_expert_weight_name("model.layers.0.mlp.experts.gate_up_proj") == (
        "model.layers.0.mlp.experts.w13_weight", None, "w13")
    assert parse_expert_weight_name("model.layers.0.mlp.experts.up_proj.weight") == (
        "model.layers.0.mlp.experts.w13_weight", None, "w3")
    for other in ("model.layers.0.mlp.shared_experts.gate_proj.weight",
                  "model.layers.0.mlp.shared_expert.up_proj.weight", "model.layers.0.mlp.gate.weight"):
        assert parse_expert_weight_name(other) is None

"""Sharded weight loading: each TP rank holds and reads only its slices.

Building and loading a model needs no collective, so every rank of a tp=2 group is
built here in this process in turn (``initialize_model_parallel(rank, 2)``, no process
group): its parameters must be its slices of the 1-rank model's (embedding / LM head
rows, q rows and KV heads, gate/up rows, down / o_proj columns, experts' intermediate
dim), its resident bytes and the bytes its lazy loads materialised about half the
1-rank figures. The multi-process forwards are in ``test_tp_forward.py``.
"""

from __future__ import annotations

from typing import Dict

import pytest
import torch

from cvllm import loader
from cvllm.distributed.parallel_state import destroy_model_parallel, initialize_model_parallel
from cvllm.loader.lazy import materialized_bytes, reset_materialized_bytes
from cvllm.models.registry import get_model_class
from tests.distributed.test_tp_forward import resident_weight_bytes, tiny_llama, tiny_qwen3_moe


@pytest.fixture
def tp_rank():
    """``tp_rank(r, size)``: layers built afterwards are rank r of size (reset after)."""
    yield lambda rank, size: initialize_model_parallel(rank, size)
    destroy_model_parallel()


def build_and_load(source) -> tuple:
    mc = loader.load_model_config(source, "f32", 64)
    model = get_model_class(mc.architecture)(mc)
    reset_materialized_bytes()
    model.load_weights(loader.iter_weights(source))
    return model, materialized_bytes()


def params(model) -> Dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in model.named_parameters()}


def test_tiny_llama_ranks_hold_their_slices(tmp_path, tp_rank):
    source = loader.resolve_model_source(str(tiny_llama(tmp_path / "llama")))
    full_model, full_read = build_and_load(source)
    full, full_bytes = params(full_model), resident_weight_bytes(full_model)
    D, H, Hkv = 16, 4, 2
    for r in range(2):
        tp_rank(r, 2)
        model, read = build_and_load(source)
        mine = params(model)
        assert 0.45 <= resident_weight_bytes(model) / full_bytes <= 0.6
        assert 0.45 <= read / full_read <= 0.6, f"rank {r} read {read / full_read:.2f}"
        rows = lambda t, n: t.narrow(0, r * n, n)  # noqa: E731
        for name in ("model.embed_tokens.weight", "lm_head.weight"):  # 512 rows: 256 each
            assert torch.equal(mine[name], rows(full[name], 256))
        pre = "model.layers.1."
        qkv, qkv_full = (m[pre + "self_attn.qkv_proj.weight"] for m in (mine, full))
        q_full, k_full = qkv_full[: H * D], qkv_full[H * D : (H + Hkv) * D]
        assert torch.equal(qkv[: 2 * D], rows(q_full, 2 * D))  # query heads 2r, 2r+1
        assert torch.equal(qkv[2 * D : 3 * D], rows(k_full, D))  # KV head r
        o = mine[pre + "self_attn.o_proj.weight"]
        assert torch.equal(o, full[pre + "self_attn.o_proj.weight"].narrow(1, r * 2 * D, 2 * D))
        # The row-parallel bias is loaded whole on every rank and added once, by rank 0.
        assert torch.equal(mine[pre + "mlp.down_proj.bias"], full[pre + "mlp.down_proj.bias"])
        gate_up, gate_up_full = (m[pre + "mlp.gate_up_proj.weight"] for m in (mine, full))
        assert torch.equal(gate_up[:64], rows(gate_up_full[:128], 64))
        assert torch.equal(gate_up[64:], rows(gate_up_full[128:], 64))
        norm = pre + "input_layernorm.weight"
        assert torch.equal(mine[norm], full[norm])
        destroy_model_parallel()


def test_qwen3_moe_gguf_experts_shard_by_intermediate_dim(tmp_path, tp_rank):
    """Stacked GGUF experts ``[E, I, H]`` / ``[E, H, I]`` narrowed before reading."""
    from tools.gguf_export import qwen3moe

    from transformers import AutoModelForCausalLM

    folder = tiny_qwen3_moe(tmp_path / "moe", mlp_only_layers=())  # GGUF: every layer MoE
    qwen3moe.export(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32),
                    folder / "tiny.gguf")
    source = loader.resolve_model_source(str(folder), "tiny.gguf")
    full_model, full_read = build_and_load(source)
    full = params(full_model)
    name = "model.layers.0.mlp.experts."
    inter = 32 // 2
    for r in range(2):
        tp_rank(r, 2)
        model, read = build_and_load(source)
        mine = params(model)
        w13, w13_full = mine[name + "w13_weight"], full[name + "w13_weight"]  # [E, 2I/tp, H]
        assert torch.equal(w13[:, :inter], w13_full[:, r * inter : (r + 1) * inter])
        assert torch.equal(w13[:, inter:], w13_full[:, 32 + r * inter : 32 + (r + 1) * inter])
        assert torch.equal(mine[name + "w2_weight"],
                           full[name + "w2_weight"][..., r * inter : (r + 1) * inter])
        assert 0.45 <= read / full_read <= 0.6, f"rank {r} read {read / full_read:.2f}"
        destroy_model_parallel()


def test_tp_size_not_dividing_the_heads_is_refused(tmp_path, tp_rank):
    source = loader.resolve_model_source(str(tiny_llama(tmp_path / "llama")))
    tp_rank(0, 3)  # 4 query heads over 3 ranks
    with pytest.raises(ValueError, match="not divisible"):
        build_and_load(source)

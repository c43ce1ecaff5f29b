"""The linear-attention layers of Qwen3-Next and Qwen3.5 (projections + GatedDeltaNet
core) against transformers' own modules, unsharded and as 2 simulated TP ranks (one
process, parallel_state patched per rank, the out_proj all-reduce summed by hand), over
a batch of two sequences whose states start in dirty slots."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers import Qwen3NextConfig
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf35
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
from transformers.models.qwen3_next import modeling_qwen3_next as hfnext

from cvllm.config import ModelConfig
from cvllm.distributed import parallel_state
from cvllm.distributed.parallel_state import GroupCoordinator
from cvllm.layers import linear as linear_mod
from cvllm.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5GatedDeltaNet
from cvllm.models.qwen3_next import Qwen3NextGatedDeltaNet

DIMS = dict(vocab_size=256, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=8, linear_value_head_dim=4, linear_conv_kernel_dim=4)
LENS = [5, 3]


@pytest.fixture
def as_rank(monkeypatch):
    monkeypatch.setattr(linear_mod, "tensor_model_parallel_all_reduce", lambda x: x)

    def set_rank(rank, size):
        coordinator = GroupCoordinator(rank_in_group=rank, world_size=size)
        monkeypatch.setattr(parallel_state, "_TP", coordinator)

    return set_rank


def _hf_layer(kind):
    torch.manual_seed(0)
    if kind == "next":
        cfg = Qwen3NextConfig(**DIMS)
        layer = hfnext.Qwen3NextGatedDeltaNet(cfg, 0)
    else:
        cfg = Qwen3_5TextConfig(**DIMS)
        layer = hf35.Qwen3_5GatedDeltaNet(cfg, 0)
    with torch.no_grad():
        for p in (layer.dt_bias, layer.norm.weight):
            p.add_(torch.randn(p.shape) * 0.3)
    return cfg, layer.eval()


def _ours(kind, cfg, hf_layer):
    """Our layer (this rank's shard), loaded through its weight loaders like a model
    would, with Qwen3.5's b/a projections fused by the model's stacked mapping."""
    mc = ModelConfig(architecture="x", hf_config=cfg.to_dict())
    cls = Qwen3NextGatedDeltaNet if kind == "next" else Qwen3_5GatedDeltaNet
    layer = cls(mc, torch.float32, None, "layer")
    params = dict(layer.named_parameters())
    for name, tensor in hf_layer.state_dict().items():
        name, shard = "." + name, None
        for fused, ckpt, sid in Qwen3_5ForCausalLM.stacked_params_mapping:
            if ckpt + "." in name:
                name, shard = name.replace(ckpt, fused), sid
                break
        p = params[name[1:]]
        p.weight_loader(p, tensor) if shard is None else p.weight_loader(p, tensor, shard)
    return layer


def _run(layer, hidden, slots=(2, 0), num_slots=3):
    spec = layer.state_spec(torch.float32)
    g = torch.Generator().manual_seed(5)
    state = tuple(torch.randn((num_slots, *s), generator=g).to(dt)
                  for s, dt in zip(spec.shapes, spec.dtypes))  # dirty slots
    qsl = np.concatenate([[0], np.cumsum(LENS)])
    meta = SimpleNamespace(
        num_tokens=int(qsl[-1]), query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        query_start_loc_cpu=qsl, state_slots=torch.tensor(slots), num_decodes=0,
        has_initial_state=torch.zeros(len(LENS), dtype=torch.bool))
    with torch.no_grad():
        return layer(None, hidden, state, meta)


@pytest.mark.parametrize("kind", ["next", "qwen3_5"])
def test_linear_attention_layer_matches_transformers_and_tp(kind, as_rank):
    cfg, hf_layer = _hf_layer(kind)
    hidden = torch.randn(sum(LENS), DIMS["hidden_size"])
    with torch.no_grad():
        want = torch.cat([hf_layer(h[None])[0] for h in hidden.split(LENS)])
    as_rank(0, 1)
    full = _run(_ours(kind, cfg, hf_layer), hidden)
    torch.testing.assert_close(full, want, rtol=1e-4, atol=1e-5)
    partial = []
    for rank in range(2):
        as_rank(rank, 2)
        partial.append(_run(_ours(kind, cfg, hf_layer), hidden))
    torch.testing.assert_close(partial[0] + partial[1], want, rtol=1e-4, atol=1e-5)


def test_qwen3_5_moe_loads_fused_and_per_expert_checkpoints(tmp_path):
    """transformers' in-memory layout (``experts.gate_up_proj [E, 2I, H]``) and the
    per-expert layout ``save_pretrained`` writes load to the same parameters."""
    from safetensors.torch import load_file
    from transformers import Qwen3_5MoeForCausalLM as HFMoe
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig

    from cvllm.models.qwen3_5 import Qwen3_5MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3_5MoeTextConfig(**DIMS, num_experts=4, num_experts_per_tok=2,
                               moe_intermediate_size=8, shared_expert_intermediate_size=8)
    hf = HFMoe(cfg)
    assert "model.layers.0.mlp.experts.gate_up_proj" in hf.state_dict()
    hf.save_pretrained(tmp_path)
    per_expert = load_file(str(tmp_path / "model.safetensors"))
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in per_expert
    mc = ModelConfig(architecture="Qwen3_5MoeForCausalLM", hf_config=cfg.to_dict(), max_model_len=64)
    fused_model, split_model = Qwen3_5MoeForCausalLM(mc), Qwen3_5MoeForCausalLM(mc)
    fused_model.load_weights(hf.state_dict().items())
    split_model.load_weights(per_expert.items())
    for (name, a), (_, b) in zip(fused_model.named_parameters(), split_model.named_parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)

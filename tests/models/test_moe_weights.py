"""MoE checkpoints in each expert layout load to the same weights: per expert (Hub files and
transformers' save_pretrained), fused ``experts.gate_up_proj`` / ``down_proj`` (transformers'
in-memory layout, Qwen3.5-MoE files); a missing expert tensor is named in the error."""

import pytest
import torch
from safetensors.torch import load_file
from transformers import Qwen3MoeConfig
from transformers import Qwen3MoeForCausalLM as HFQwen3Moe

from cvllm.config import ModelConfig
from cvllm.models.qwen3_moe import Qwen3MoeForCausalLM
from cvllm.models.utils import WeightLoadError
from tests.models.family_harness import hf_config_of


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    torch.manual_seed(0)
    hf = HFQwen3Moe(Qwen3MoeConfig(hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                                   num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                   head_dim=16, num_experts=4, num_experts_per_tok=2, vocab_size=64,
                                   mlp_only_layers=[1]))
    folder = tmp_path_factory.mktemp("q3moe")
    hf.save_pretrained(folder)
    return hf, folder


def _model(folder):
    cfg = hf_config_of(folder)
    return Qwen3MoeForCausalLM(ModelConfig(cfg["architectures"][0], cfg, dtype="f32"))


def test_per_expert_and_fused_layouts_load_the_same(tiny):
    hf, folder = tiny
    saved = load_file(str(folder / "model.safetensors"))
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in saved  # per expert on disk
    fused = hf.state_dict()
    assert "model.layers.0.mlp.experts.gate_up_proj" in fused  # fused in memory
    a, b = _model(folder), _model(folder)
    a.load_weights(saved.items())
    b.load_weights(fused.items())
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), name
    experts = a.model.layers[0].mlp.experts
    assert torch.equal(experts.w13_weight, fused["model.layers.0.mlp.experts.gate_up_proj"])
    assert torch.equal(experts.w2_weight, fused["model.layers.0.mlp.experts.down_proj"])


def test_missing_expert_is_named(tiny):
    _, folder = tiny
    saved = load_file(str(folder / "model.safetensors"))
    del saved["model.layers.0.mlp.experts.2.down_proj.weight"]
    with pytest.raises(WeightLoadError, match=r"experts\.2\.down_proj\.weight"):
        _model(folder).load_weights(saved.items())

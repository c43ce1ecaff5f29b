"""--yarn-scaling-factor F: the model's rope scaling becomes YaRN at factor F with
original_max_position_embeddings = max_position_embeddings (written where every family
reads it), the default context becomes F x that, and the served model then matches a
transformers model configured with the same YaRN scaling."""

import copy

import pytest
import torch
from click.testing import CliRunner
from transformers import LlamaConfig, LlamaForCausalLM

from cvllm.cli import main
from cvllm.engine.builder import apply_yarn_scaling
from cvllm.engine.llm import LLM
from cvllm.layers.rotary import rope_parameters_from_config
from cvllm.loader.hf_config import normalize_rope
from tests.models.family_harness import (
    PROMPTS,
    cvllm_greedy,
    cvllm_last_logits,
    hf_greedy,
    hf_last_logits,
    randomize_,
    save_tiny,
)

F = 4.0


def test_flat_config_gets_yarn_and_keeps_theta_and_partial_factor():
    hf = normalize_rope(dict(max_position_embeddings=64, rope_theta=5e5, partial_rotary_factor=0.5,
                             rope_scaling={"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0}))
    assert apply_yarn_scaling(hf, F) == 256
    p = rope_parameters_from_config(hf)
    assert p["rope_type"] == "yarn" and p["factor"] == F
    assert p["original_max_position_embeddings"] == 64 and p["rope_theta"] == 5e5
    assert p["partial_rotary_factor"] == 0.5 and "low_freq_factor" not in p
    assert hf["rope_scaling"]["rope_type"] == "yarn"


def test_transformers5_rope_parameters_are_rewritten():
    hf = normalize_rope(dict(max_position_embeddings=32, rope_parameters={
        "rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25}))
    apply_yarn_scaling(hf, 2.0)
    assert hf["rope_parameters"] == {
        "rope_theta": 1e4, "partial_rotary_factor": 0.25, "rope_type": "yarn", "factor": 2.0,
        "original_max_position_embeddings": 32,
    }


def test_per_layer_type_rope_scales_the_global_layers_only():
    nested = {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
              "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}}
    hf = normalize_rope(dict(max_position_embeddings=128, rope_parameters=copy.deepcopy(nested)))
    apply_yarn_scaling(hf, F)
    assert hf["rope_parameters"]["sliding_attention"] == nested["sliding_attention"]
    assert hf["rope_parameters"]["full_attention"] == {
        "rope_theta": 1e6, "rope_type": "yarn", "factor": F,
        "original_max_position_embeddings": 128,
    }


def test_bad_factor_is_refused_before_loading():
    res = CliRunner().invoke(main, ["serve", "--cpu", "--yarn-scaling-factor", "0.5"])
    assert res.exit_code == 2 and "--yarn-scaling-factor" in res.output


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama_plain")
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = LlamaForCausalLM(cfg).eval()
    randomize_(hf)
    save_tiny(hf, folder)
    yarn_cfg = copy.deepcopy(cfg)
    yarn_cfg.rope_parameters = {"rope_type": "yarn",
                                "rope_theta": cfg.rope_parameters["rope_theta"],
                                "factor": F, "original_max_position_embeddings": 64}
    hf_yarn = LlamaForCausalLM(yarn_cfg).eval()
    hf_yarn.load_state_dict(hf.state_dict())
    return folder, hf, hf_yarn


def test_served_model_matches_transformers_yarn(tiny_llama):
    folder, hf, hf_yarn = tiny_llama
    llm = LLM(weight_path=str(folder), cpu=True, dtype="f32", yarn_scaling_factor=F)
    assert llm.engine.config.model.max_model_len == int(F * 64)
    ours = cvllm_last_logits(llm)
    for a, b, plain in zip(ours, hf_last_logits(hf_yarn), hf_last_logits(hf)):
        err = (a - b).abs().max().item()
        assert err <= 1e-4
        # The override changed something: plain rope is much farther away than our error.
        assert (a - plain).abs().max().item() > max(5e-4, 20 * err)
    assert cvllm_greedy(llm) == hf_greedy(hf_yarn, PROMPTS)

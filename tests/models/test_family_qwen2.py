"""Qwen2ForCausalLM against transformers: q/k/v bias (o_proj none), GQA, tied embeddings,
and sliding-window layers from use_sliding_window / max_window_layers; GGUF ``qwen2``."""

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from cvllm.attention.specs import FullAttentionSpec, SlidingWindowSpec
from cvllm.config import ModelConfig
from cvllm.models.qwen2 import qwen_sliding_windows
from tests.models.family_harness import (check_against_hf, check_gguf_against_hf, cvllm_llm,
                                         randomize_, save_tiny)

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)


def test_qwen2_family(tmp_path):
    torch.manual_seed(0)
    # Window 5 is shorter than every prompt: layers 1 and 2 see only their last 5 tokens.
    cfg = Qwen2Config(**TINY, use_sliding_window=True, sliding_window=5, max_window_layers=1,
                      tie_word_embeddings=True)
    hf = Qwen2ForCausalLM(cfg)
    randomize_(hf)
    folder = save_tiny(hf, tmp_path)
    llm = cvllm_llm(folder)
    model = llm.engine.runner.model
    assert [layer.self_attn.attn.sliding_window for layer in model.model.layers] == [None, 5, 5]
    specs = llm.engine.runner.cache_specs  # from the layers' Attention modules
    assert isinstance(specs[0], FullAttentionSpec) and isinstance(specs[1], SlidingWindowSpec)
    assert specs[2].window == 5
    check_against_hf(hf, folder, llm=llm)


def test_qwen2_gguf(tmp_path):
    from tools.gguf_export import qwen2 as gguf_qwen2

    torch.manual_seed(1)
    hf = Qwen2ForCausalLM(Qwen2Config(**TINY, tie_word_embeddings=False))
    randomize_(hf)
    folder = save_tiny(hf, tmp_path)
    gguf_qwen2.export(hf, folder / "tiny.gguf")
    check_gguf_against_hf(hf, folder, "tiny.gguf", transformers_loads=True)


def _config(**hf) -> ModelConfig:
    base = dict(architectures=["Qwen2ForCausalLM"], num_hidden_layers=4, num_attention_heads=4,
                hidden_size=64, vocab_size=256)
    return ModelConfig(architecture="Qwen2ForCausalLM", hf_config={**base, **hf})


def test_sliding_windows_from_older_configs():
    # Released Qwen2 config.json files carry a window but switch it off.
    assert qwen_sliding_windows(_config(use_sliding_window=False, sliding_window=32768,
                                        max_window_layers=2)) == [None] * 4
    # Without layer_types (pre-transformers-5 files) max_window_layers decides.
    assert qwen_sliding_windows(_config(use_sliding_window=True, sliding_window=8,
                                        max_window_layers=2)) == [None, None, 8, 8]
    types = ["sliding_attention", "full_attention"] * 2
    assert qwen_sliding_windows(_config(use_sliding_window=True, sliding_window=8,
                                        layer_types=types)) == [8, None, 8, None]

"""Gemma 3 against transformers: Gemma3ForCausalLM (q/k norms, local and global rope bases
with linear scaling on the global layers only, a sliding pattern from ``layer_types`` with
both kinds of layer, window 6 shorter than every prompt + generation, GQA,
query_pre_attn_scalar != head_dim); the text model of a Gemma3ForConditionalGeneration
checkpoint (with a tiny SigLIP vision tower that cvllm skips); older config spellings;
and a llama.cpp-style GGUF that transformers' GGUF loader also reads."""

import torch
from transformers import (Gemma3Config, Gemma3ForCausalLM, Gemma3ForConditionalGeneration,
                          Gemma3TextConfig)

from cvllm.attention.specs import FullAttentionSpec, SlidingWindowSpec
from cvllm.config import ModelConfig
from cvllm.loader.hf_config import normalize_rope
from cvllm.models.gemma3 import Gemma3ForCausalLM as CvllmGemma3, gemma3_rope_parameters
from tests.models.family_harness import (check_against_hf, check_gguf_against_hf, cvllm_llm,
                                         randomize_, save_tiny)
from tests.models.test_family_gemma2 import TINY, assert_matters

S, F = "sliding_attention", "full_attention"
ROPE = {F: {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000.0},
        S: {"rope_type": "default", "rope_theta": 50.0}}


def tiny_text_config(**kw) -> dict:
    return dict(TINY, head_dim=32, query_pre_attn_scalar=24, sliding_window=6,
                layer_types=[S, S, F, S], rope_parameters=ROPE, **kw)


def test_gemma3_family(tmp_path):
    torch.manual_seed(0)
    hf = Gemma3ForCausalLM(Gemma3TextConfig(**tiny_text_config())).eval()
    randomize_(hf)
    assert_matters(hf, sliding_window=64)
    folder = save_tiny(hf, tmp_path)
    llm = cvllm_llm(folder)
    specs = llm.engine.runner.model.cache_specs()
    assert [type(s) for s in specs] == [SlidingWindowSpec, SlidingWindowSpec,
                                        FullAttentionSpec, SlidingWindowSpec]
    assert specs[0].window == 6
    check_against_hf(hf, folder, llm=llm)


def test_gemma3_conditional_generation(tmp_path):
    """A checkpoint saved from HF's Gemma3ForConditionalGeneration (config under
    text_config, text weights as ``language_model.model.*``, SigLIP tower and projector
    weights beside them) served by cvllm, compared with that same HF model on text-only
    prompts: with no pixel_values its forward is the language model alone, so this is
    the model users load, not a re-built causal LM."""
    torch.manual_seed(2)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=32, patch_size=8)
    cfg = Gemma3Config(text_config=tiny_text_config(), vision_config=vision,
                       mm_tokens_per_image=4, boi_token_index=253, eoi_token_index=254,
                       image_token_index=255)
    hf = Gemma3ForConditionalGeneration(cfg).eval()
    randomize_(hf)
    # The text model is test_gemma3_family's, which checks the prefix cache.
    check_against_hf(hf, save_tiny(hf, tmp_path), prefix_cache=False)


def test_gemma3_legacy_config():
    """Pre-transformers-5 config.json keys (Google's files): rope_theta for global layers
    with their rope_scaling, rope_local_base_freq for the sliding ones, and
    sliding_window_pattern instead of layer_types."""
    cfg = normalize_rope(dict(
        TINY, architectures=["Gemma3ForCausalLM"], num_hidden_layers=7, head_dim=16,
        rope_theta=1_000_000.0, rope_local_base_freq=10_000.0, sliding_window=5,
        rope_scaling={"type": "linear", "factor": 8.0}, sliding_window_pattern=6))
    glob, local = gemma3_rope_parameters(cfg)
    assert (glob["rope_type"], glob["factor"], glob["rope_theta"]) == ("linear", 8.0, 1e6)
    assert (local["rope_type"], local["rope_theta"]) == ("default", 1e4)
    model = CvllmGemma3(ModelConfig(architecture="Gemma3ForCausalLM", hf_config=cfg,
                                    max_model_len=64))
    windows = [layer.self_attn.attn.sliding_window for layer in model.model.layers]
    assert windows == [5, 5, 5, 5, 5, None, 5]
    ropes = [layer.self_attn.rotary_emb for layer in model.model.layers]
    assert ropes[5].base == 1e6 and ropes[5].scaling_factor == 8.0
    assert ropes[0].base == 1e4 and type(ropes[0]).__name__ == "RotaryEmbedding"


def test_gemma3_gguf(tmp_path):
    """transformers' GGUF loader takes Gemma 3's sliding pattern (every 6th layer global),
    query_pre_attn_scalar (256) and local rope base from its config defaults and ignores
    rope scaling, as llama.cpp implies them: 6 layers, head_dim 256, no scaling."""
    from tools.gguf_export import gemma3 as gguf_gemma3

    torch.manual_seed(1)
    cfg = Gemma3TextConfig(**dict(TINY, num_hidden_layers=6, head_dim=256, sliding_window=6))
    hf = Gemma3ForCausalLM(cfg).eval()
    randomize_(hf)
    folder = save_tiny(hf, tmp_path)
    gguf_gemma3.export(hf, folder / "tiny.gguf")
    check_gguf_against_hf(hf, folder, "tiny.gguf")


def test_gemma3_gguf_metadata(tmp_path):
    """What cvllm reads from a gemma3 GGUF beyond transformers: linear rope scaling of the
    global layers only, the llama.cpp sliding pattern, no softcaps."""
    from cvllm.loader.gguf_config import gguf_to_hf_config
    from cvllm.loader.gguf_loader import open_gguf
    from tools.gguf_export import gemma3 as gguf_gemma3

    kw = dict(TINY, num_hidden_layers=7, head_dim=16, sliding_window=6)
    cfg = Gemma3TextConfig(**kw, rope_scaling={"rope_type": "linear", "factor": 8.0})
    path = gguf_gemma3.export(Gemma3ForCausalLM(cfg), tmp_path / "m.gguf")
    got = gguf_to_hf_config(open_gguf(path))
    assert got["layer_types"] == [S] * 5 + [F, S]
    assert got["query_pre_attn_scalar"] == 16 and got["sliding_window"] == 6
    assert got["final_logit_softcapping"] is None and got["attn_logit_softcapping"] is None
    glob, local = gemma3_rope_parameters(got)
    assert (glob["rope_type"], glob["factor"], glob["rope_theta"]) == ("linear", 8.0, 1e6)
    assert (local["rope_type"], local["rope_theta"]) == ("default", 1e4)

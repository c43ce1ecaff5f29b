"""Gemma 2 against transformers: a tiny random Gemma2ForCausalLM with every feature of the
family switched on and made to matter (each ``_assert_matters`` check proves the HF model's
logits change without it): attention and final-logit softcaps small enough to bite, 4
layers alternating sliding / global with a window (6) shorter than every prompt + its
generation, GQA, head_dim != hidden/heads, query_pre_attn_scalar != head_dim, large
weights so the softcaps and window change the outputs; served again with blocks smaller
than the sequences, so the sliding layers' cache group frees blocks mid-sequence. Then the
same family from a llama.cpp-style GGUF, which transformers' GGUF loader also reads."""

import copy

import torch
from transformers import Gemma2Config, Gemma2ForCausalLM

from cvllm.attention.specs import FullAttentionSpec, SlidingWindowSpec
from cvllm.core.block_manager import BlockManager
from tests.models.family_harness import (PROMPTS, check_against_hf, check_gguf_against_hf,
                                         cvllm_greedy, cvllm_llm, randomize_, save_tiny)

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=128,
            initializer_range=0.3)


def _last_logits(hf, prompt):
    with torch.no_grad():
        return hf(torch.tensor([prompt])).logits[0, -1]


def assert_matters(hf, **changes):
    """The HF model's logits move by more than 1e-2 when ``changes`` are applied to its
    config: the feature is exercised, not merely present."""
    other = copy.deepcopy(hf)
    for key, value in changes.items():
        setattr(other.config, key, value)
        for layer in getattr(other.model, "layers", []):
            attn = layer.self_attn
            if key == "attn_logit_softcapping":
                attn.attn_logit_softcapping = value
            if key == "sliding_window":
                attn.sliding_window = value if attn.sliding_window else None
    diff = (_last_logits(hf, PROMPTS[1]) - _last_logits(other, PROMPTS[1])).abs().max().item()
    assert diff > 1e-2, f"{changes} changes the logits by only {diff:.1e}"


def test_gemma2_family(tmp_path, monkeypatch):
    torch.manual_seed(0)
    cfg = Gemma2Config(**TINY, head_dim=32, query_pre_attn_scalar=24, sliding_window=6,
                       attn_logit_softcapping=4.0, final_logit_softcapping=3.0)
    hf = Gemma2ForCausalLM(cfg).eval()
    randomize_(hf)
    assert_matters(hf, attn_logit_softcapping=None)
    assert_matters(hf, final_logit_softcapping=None)
    assert_matters(hf, sliding_window=64)
    folder = save_tiny(hf, tmp_path)
    llm = cvllm_llm(folder)
    specs = llm.engine.runner.model.cache_specs()
    assert [type(s) for s in specs] == [SlidingWindowSpec, FullAttentionSpec] * 2
    assert specs[0].window == 6 and specs[0].num_kv_heads == 2 and specs[0].head_dim == 32
    check_against_hf(hf, folder, llm=llm)
    # Blocks of 8 < prompt + generation: the sliding layers' group frees blocks that left
    # the window while the global layers keep theirs; tokens must not change.
    freed = []
    remove = BlockManager.remove_out_of_window_blocks

    def spy(self, seq):
        out = remove(self, seq)
        freed.extend(out)
        return out

    monkeypatch.setattr(BlockManager, "remove_out_of_window_blocks", spy)
    small_blocks = cvllm_llm(folder, prefill_chunk_size=4, block_size=8)
    assert cvllm_greedy(small_blocks) == cvllm_greedy(llm)
    assert freed, "no out-of-window block was freed"


def test_gemma2_gguf(tmp_path):
    """transformers' GGUF loader reads only some Gemma 2 keys and takes its config
    defaults for the rest (softcaps 50 / 30, query_pre_attn_scalar 256): the tiny model
    uses those values, with head_dim 256 so that llama.cpp's implied attention scale
    (1/sqrt(head_dim)) agrees."""
    from tools.gguf_export import gemma2 as gguf_gemma2

    torch.manual_seed(1)
    cfg = Gemma2Config(**TINY, head_dim=256, sliding_window=6)
    hf = Gemma2ForCausalLM(cfg).eval()
    randomize_(hf)
    folder = save_tiny(hf, tmp_path)
    gguf_gemma2.export(hf, folder / "tiny.gguf")
    check_gguf_against_hf(hf, folder, "tiny.gguf")

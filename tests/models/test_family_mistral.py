"""MistralForCausalLM (every layer sliding) against transformers, with a window far
smaller than prompt + generation, through the real engine: the sliding KV group frees the
blocks that fall out of the window, and the tokens still match HF's token for token."""

import math

import torch
from transformers import MistralConfig, MistralForCausalLM

from cvllm.core.block_manager import PLACEHOLDER_BLOCK
from cvllm.sampling_params import SamplingParams
from tests.models.family_harness import (
    PROMPTS,
    check_against_hf,
    cvllm_llm,
    hf_greedy,
    randomize_,
    save_tiny,
)

WINDOW = 5


def _tiny_mistral(folder):
    cfg = MistralConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                        max_position_embeddings=128, sliding_window=WINDOW, rms_norm_eps=1e-5,
                        tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = MistralForCausalLM(cfg).eval()
    randomize_(hf)
    save_tiny(hf, folder)
    return hf


def test_mistral_window_smaller_than_context_matches_hf(tmp_path):
    hf = _tiny_mistral(tmp_path)
    assert max(map(len, PROMPTS)) > WINDOW
    check_against_hf(hf, tmp_path)


def test_long_generation_keeps_only_the_windows_blocks(tmp_path):
    """60 new tokens after each prompt need up to 10 blocks of 8 with full attention; the
    whole pool has 9 for three sequences, and each keeps at most ceil(W/bs) + 2."""
    hf = _tiny_mistral(tmp_path)
    bs, new_tokens = 8, 60
    llm = cvllm_llm(tmp_path, prefill_chunk_size=8, block_size=bs, num_blocks=9, max_num_seqs=3)
    engine = llm.engine
    assert engine.kv_layout.windows == [WINDOW] and engine.block_manager.num_total_blocks == 9
    bm, most = engine.block_manager, [0]
    original_step = engine.step

    def step():
        outs = original_step()
        for seq in engine.scheduler.running:
            live = bm.num_live_blocks(seq)
            most[0] = max(most[0], live)
            assert live <= math.ceil(WINDOW / bs) + 2, seq
            ids = seq.block_ids
            assert all(b == PLACEHOLDER_BLOCK for b in ids[:len(ids) - live])  # freed = a prefix
        return outs

    engine.step = step
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    got = [r.token_ids for r in llm.generate([list(p) for p in PROMPTS], params)]
    assert most[0] >= 1 and bm.num_free_blocks == 9
    assert got == hf_greedy(hf, PROMPTS, n=new_tokens)

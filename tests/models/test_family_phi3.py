"""Phi3ForCausalLM (Phi-3/3.5/4) served by cvllm against transformers: fused qkv_proj and
gate_up_proj checkpoints, GQA, partial rotary (Phi-4-mini), sliding window, and ``longrope``
with both factor lists; and the same family from a llama.cpp ``phi3`` GGUF.

LongRoPE rule (``cvllm/layers/rotary.py``): cvllm uses the long factors everywhere iff the
served max_model_len (128 in the harness) exceeds original_max_position_embeddings, else the
short ones. HF picks per forward by sequence length (long iff length > original). The two
agree for every length tested here: with original = 6 every prompt (7+ tokens) is longer,
so HF runs long factors throughout; with original = 128 no sequence (at most 35 tokens) is
longer, so HF runs short factors throughout.
"""

import pytest
import torch
from transformers import Phi3Config, Phi3ForCausalLM

from cvllm.layers.rotary import get_rope, rope_parameters_from_config
from tests.models.family_harness import (check_against_hf, check_gguf_against_hf, cvllm_llm,
                                         randomize_, save_tiny)

HEAD_DIM, PARTIAL = 16, 0.75
N_FACTORS = int(HEAD_DIM * PARTIAL) // 2
SHORT = [1.0 + 0.05 * i for i in range(N_FACTORS)]
LONG = [1.5 + 0.7 * i for i in range(N_FACTORS)]


def _config(original=None, max_pos=128, **overrides) -> Phi3Config:
    kw = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=256, max_position_embeddings=max_pos,
              bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": PARTIAL}
    if original is not None:
        kw["original_max_position_embeddings"] = original
        rope.update(rope_type="longrope", short_factor=SHORT, long_factor=LONG)
    kw["rope_parameters"] = rope
    kw.update(overrides)
    return Phi3Config(**kw)


def _tiny(cfg: Phi3Config, seed: int) -> Phi3ForCausalLM:
    torch.manual_seed(seed)
    hf = Phi3ForCausalLM(cfg)
    randomize_(hf)
    return hf.eval()


@pytest.mark.parametrize("seq_len", [None, 6, 7, 100])
def test_longrope_matches_transformers(seq_len):
    """Frequencies and attention factor equal ROPE_INIT_FUNCTIONS['longrope'] for the list
    HF would use at seq_len, when cvllm serves that many positions (the rule above)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = _config(original=6, max_pos=128)
    want_inv, want_scale = ROPE_INIT_FUNCTIONS["longrope"](cfg, "cpu", seq_len=seq_len)
    served = seq_len or 6
    hf_cfg = cfg.to_dict()
    rope = get_rope(HEAD_DIM, served, rope_parameters_from_config(hf_cfg), 128)
    assert rope.use_long_factor == (served > 6) and rope.rotary_dim == 12
    torch.testing.assert_close(rope._compute_inv_freq(), want_inv, rtol=0, atol=0)
    assert rope.mscale == pytest.approx(want_scale, rel=1e-12)


def test_old_phi3_config_spelling():
    """Phi-3 config.json files say ``rope_scaling: {type: su|longrope, ...}`` and keep
    original_max_position_embeddings at the top level, which wins (as in HF)."""
    p = rope_parameters_from_config({
        "rope_theta": 10000.0, "original_max_position_embeddings": 4096,
        "rope_scaling": {"type": "su", "short_factor": SHORT, "long_factor": LONG,
                         "original_max_position_embeddings": 1234}})
    assert p["rope_type"] == "longrope" and p["original_max_position_embeddings"] == 4096


def test_phi3_longrope_long_factors(tmp_path):
    hf = _tiny(_config(original=6, sliding_window=8), 0)
    assert hf.model.rotary_emb.attention_scaling > 1.0
    _check_longrope(hf, tmp_path, want_long=True)


def test_phi3_longrope_short_factors(tmp_path):
    hf = _tiny(_config(original=128, max_pos=512), 1)
    assert hf.model.rotary_emb.attention_scaling > 1.0
    _check_longrope(hf, tmp_path, want_long=False)


def _check_longrope(hf, tmp_path, want_long: bool) -> None:
    folder = save_tiny(hf, tmp_path)
    llm = cvllm_llm(folder)
    rope = llm.engine.runner.model.model.layers[0].self_attn.rotary_emb
    assert rope.use_long_factor == want_long and rope.rotary_dim == 2 * N_FACTORS
    check_against_hf(hf, folder, llm=llm, prefix_cache=want_long)  # once: the sliding config


def test_phi3_gguf(tmp_path):
    """Plain rope, full rotary: what transformers' phi3 GGUF loader understands (it reads
    neither rope factors nor rope.dimension_count), so it must load the file to HF's logits."""
    from tools.gguf_export import phi3 as gguf_phi3

    hf = _tiny(_config(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}), 2)
    folder = save_tiny(hf, tmp_path)
    gguf_phi3.export(hf, folder / "tiny.gguf")
    check_gguf_against_hf(hf, folder, "tiny.gguf", transformers_loads=True)


def test_phi3_gguf_longrope(tmp_path):
    """longrope factors as rope_factors_long/short tensors, partial rotary from
    rope.dimension_count, sliding window, tied embeddings (no output.weight)."""
    from tools.gguf_export import phi3 as gguf_phi3

    hf = _tiny(_config(original=6, sliding_window=8, tie_word_embeddings=True), 3)
    folder = save_tiny(hf, tmp_path)
    gguf_phi3.export(hf, folder / "tiny.gguf")
    check_gguf_against_hf(hf, folder, "tiny.gguf", transformers_loads=False)

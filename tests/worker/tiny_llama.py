"""Test helpers: a word-level tokenizer made in-process (no download) and a tiny random
Llama folder (config.json + safetensors + tokenizer) that ``LLM(weight_path=...)`` loads
through the real builder, on the CPU or a GPU machine without network."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict

VOCAB = 512

LLAMA_CFG: Dict[str, Any] = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=32,
    vocab_size=VOCAB,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    initializer_range=0.1,  # peaked logits: greedy tokens are not near-ties
    bos_token_id=1,
    eos_token_id=2,
)


def word_tokenizer(vocab: int = VOCAB):
    """A fast tokenizer over words ``t0 .. t{vocab-1}`` (t1 BOS, t2 EOS)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"t{i}": i for i in range(vocab)}
    tok = Tokenizer(models.WordLevel(words, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="t1", eos_token="t2",
                                   unk_token="t0")


def write_tiny_llama(folder: Path, seed: int = 0, **overrides: Any) -> Path:
    """Random-weight Llama (HF's own init, ``seed``) saved with its tokenizer in ``folder``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(LLAMA_CFG, **overrides)
    torch.manual_seed(seed)
    LlamaForCausalLM(LlamaConfig(**cfg)).save_pretrained(folder, safe_serialization=True)
    word_tokenizer(cfg["vocab_size"]).save_pretrained(folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    return folder


GEMMA2_CFG: Dict[str, Any] = dict(
    hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, vocab_size=VOCAB, max_position_embeddings=512,
    query_pre_attn_scalar=24, sliding_window=24, attn_logit_softcapping=20.0,
    final_logit_softcapping=15.0, initializer_range=0.3, tie_word_embeddings=False,
    bos_token_id=1, eos_token_id=2,
    pad_token_id=0,
)


def write_tiny_gemma2(folder: Path, seed: int = 0, **overrides: Any) -> Path:
    """Random Gemma 2 (alternating sliding / full layers: two KV cache groups; softcaps)
    saved with its tokenizer in ``folder``."""
    import torch
    from transformers import Gemma2Config, Gemma2ForCausalLM

    cfg = dict(GEMMA2_CFG, **overrides)
    torch.manual_seed(seed)
    model = Gemma2ForCausalLM(Gemma2Config(**cfg))
    with torch.no_grad():  # norms start at 0 (scale 1 + w): give them something to do
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.3)
    model.save_pretrained(folder, safe_serialization=True)
    word_tokenizer(cfg["vocab_size"]).save_pretrained(folder)
    return folder

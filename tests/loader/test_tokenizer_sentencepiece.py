"""A GGUF whose vocabulary is of the SentencePiece kind (``tokenizer.ggml.model = llama``:
pieces with scores, '▁' for spaces, byte-fallback tokens) becomes a working tokenizer;
the BPE kind is covered by the default model's tests."""

import numpy as np

from cvllm.loader import ModelSource, load_tokenizer
from tools.gguf_export.common import write_gguf

PIECES = ["▁", "▁h", "▁he", "▁hel", "▁hell", "▁hello", "▁w", "▁wo", "▁wor", "▁worl", "▁world",
          "h", "e", "l", "o", "w", "r", "d", "he", "ll", "wo"]


def _sentencepiece_gguf(path):
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)] + PIECES
    kv = {
        "llama.context_length": 64, "llama.embedding_length": 8, "llama.block_count": 1,
        "llama.feed_forward_length": 16, "llama.attention.head_count": 2,
        "llama.attention.head_count_kv": 2, "llama.attention.layer_norm_rms_epsilon": 1e-5,
        "llama.rope.dimension_count": 4, "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [0.0] * 259 + [-float(i) for i in range(len(PIECES))],
        "tokenizer.ggml.token_type": [2, 3, 3] + [6] * 256 + [1] * len(PIECES),
        "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0, "tokenizer.ggml.add_bos_token": True,
    }
    return write_gguf(path, "llama", kv, {"token_embd.weight": np.zeros((len(tokens), 8), np.float32)})


def test_sentencepiece_vocabulary(tmp_path, monkeypatch):
    monkeypatch.setenv("CVLLM_CACHE_DIR", str(tmp_path / "cache"))
    tok = load_tokenizer(ModelSource("gguf", _sentencepiece_gguf(tmp_path / "sp.gguf")))
    ids = tok.encode("hello world")
    assert tok.convert_ids_to_tokens(ids) == ["<s>", "▁hello", "▁world"]
    assert tok.decode(ids, skip_special_tokens=True) == "hello world"
    # 'y' is not a piece: it falls back to its byte token, and decodes back.
    hey = tok.encode("hey", add_special_tokens=False)
    assert tok.convert_ids_to_tokens(hey) == ["▁he", "<0x79>"]
    assert tok.decode(hey) == "hey"
    assert tok.eos_token_id == 2 and tok.bos_token_id == 1

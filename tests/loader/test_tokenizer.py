"""Tokenizers: from GGUF metadata (converted once, then cached) and from HF folders."""

from __future__ import annotations

import json

import pytest

from cvllm.loader import ModelLoadError, ModelSource, load_tokenizer
from cvllm.loader import tokenizer as tk

TEXTS = ["Hello, world!", "  leading spaces and\ttabs\n\nnewlines", "Ünïcödé 東京 🙂 12345",
         "<|im_start|>user\nhi<|im_end|>", ""]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"}, {"role": "user", "content": "Thanks"}]


@pytest.fixture(scope="module")
def gguf_tokenizer(smollm2_gguf):
    return load_tokenizer(ModelSource("gguf", smollm2_gguf))


@pytest.mark.slow
def test_gguf_tokenizer_matches_transformers(gguf_tokenizer, hf_gguf_tokenizer):
    ours, ref = gguf_tokenizer, hf_gguf_tokenizer
    assert ours.is_fast and len(ours) == len(ref) == 49152
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == ref.encode(text), text
        assert ours.decode(ids) == ref.decode(ids) == text
    assert (ours.bos_token_id, ours.eos_token_id) == (ref.bos_token_id, ref.eos_token_id) == (1, 2)


@pytest.mark.slow
def test_gguf_chat_template(gguf_tokenizer, hf_gguf_tokenizer, smollm2_gguf):
    from cvllm.loader.gguf_config import meta
    from cvllm.loader.gguf_loader import open_gguf

    assert gguf_tokenizer.chat_template == meta(open_gguf(smollm2_gguf), "tokenizer.chat_template")
    for prompt in (CHAT, CHAT[1:2]):
        kw = dict(tokenize=False, add_generation_prompt=True)
        ours = gguf_tokenizer.apply_chat_template(prompt, **kw)
        ref = hf_gguf_tokenizer.apply_chat_template(prompt, **kw)
        assert ours == ref and ours.endswith("<|im_start|>assistant\n")
    text = gguf_tokenizer.apply_chat_template(CHAT[1:2], tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


def test_gguf_tokenizer_is_cached(gguf_tokenizer, smollm2_gguf):
    entry = tk.tokenizers_cache_dir() / tk.tokenizer_cache_key(smollm2_gguf)
    assert (entry / tk._DONE_MARK).is_file() and (entry / "tokenizer.json").is_file()
    again = tk._from_gguf(smollm2_gguf)  # from the cache entry
    assert again.encode(TEXTS[2]) == gguf_tokenizer.encode(TEXTS[2])
    assert again.chat_template == gguf_tokenizer.chat_template


def test_damaged_cache_entry_and_vocabless_gguf(tmp_path, monkeypatch, make_tiny_gguf, caplog):
    # The tiny GGUF has no vocabulary: a (damaged) cache entry is ignored with a warning,
    # and the conversion fails with a clear error.
    _, path = make_tiny_gguf()
    monkeypatch.setenv("CVLLM_CACHE_DIR", str(tmp_path / "cache"))
    entry = tk.tokenizers_cache_dir() / tk.tokenizer_cache_key(path)
    entry.mkdir(parents=True)
    (entry / tk._DONE_MARK).write_text("ok")
    (entry / "tokenizer.json").write_text("{broken")
    with pytest.raises(ModelLoadError, match="cannot build a tokenizer from the GGUF metadata"):
        load_tokenizer(ModelSource("gguf", path))
    assert "damaged tokenizer cache" in caplog.text


def test_hf_folder_tokenizer(tmp_path, gguf_tokenizer, tiny_llama_dir):
    folder = tiny_llama_dir()
    gguf_tokenizer.save_pretrained(str(folder))
    tok = load_tokenizer(ModelSource("hf", folder))
    assert tok.encode(TEXTS[0]) == gguf_tokenizer.encode(TEXTS[0])
    assert tok.chat_template == gguf_tokenizer.chat_template


def test_tokenizer_folder_overrides_gguf(tmp_path, gguf_tokenizer, smollm2_gguf):
    folder = tmp_path / "tok"
    gguf_tokenizer.save_pretrained(str(folder))
    (folder / "chat_template.jinja").write_text("{{ 'custom' }}")
    tok = load_tokenizer(ModelSource("gguf", smollm2_gguf, folder))
    assert tok.chat_template == "{{ 'custom' }}"


def test_hf_folder_without_tokenizer(tiny_llama_dir):
    folder = tiny_llama_dir()
    bad = {"tokenizer_class": "NoSuchTokenizer"}
    (folder / "tokenizer_config.json").write_text(json.dumps(bad))
    with pytest.raises(ModelLoadError, match="cannot load the tokenizer"):
        load_tokenizer(ModelSource("hf", folder))

"""GGUF: config from metadata, tensor names, Q/K un-permutation, validation."""

from __future__ import annotations

import math
import shutil

import gguf
import numpy as np
import pytest
import torch

from cvllm.loader import ModelLoadError, ModelSource, iter_weights, load_model_config
from cvllm.loader.gguf_loader import clear_gguf_cache, gguf_config, iter_gguf_weights, open_gguf
from cvllm.loader.gguf_names import hf_tensor_name, get_arch, unpermute_qk


@pytest.fixture(autouse=True)
def _fresh_reader_cache():
    clear_gguf_cache()
    yield
    clear_gguf_cache()


# --- the real default model -------------------------------------------------------------


def test_smollm2_config(smollm2_gguf):
    cfg = load_model_config(ModelSource("gguf", smollm2_gguf), max_model_len=1024)
    hf = cfg.hf_config
    assert cfg.architecture == "LlamaForCausalLM" and hf["model_type"] == "llama"
    assert (cfg.num_layers, hf["hidden_size"], cfg.num_heads, cfg.num_kv_heads) == (30, 576, 9, 3)
    assert cfg.head_dim == 64 and hf["intermediate_size"] == 1536
    assert cfg.vocab_size == 49152 and hf["tie_word_embeddings"] is True
    assert hf["max_position_embeddings"] == 8192 and cfg.max_model_len == 1024
    assert hf["rms_norm_eps"] == 1e-5 and hf["rope_theta"] == 100000.0
    assert hf["rope_scaling"] is None and hf["hidden_act"] == "silu"
    assert cfg.eos_token_ids == [2] and cfg.bos_token_id == 1 and hf["pad_token_id"] == 2
    assert cfg.source == str(smollm2_gguf)


@pytest.mark.slow
def test_smollm2_config_matches_transformers(smollm2_gguf, hf_gguf_model):
    ref = hf_gguf_model.config
    ours = gguf_config(smollm2_gguf)
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings",
                "tie_word_embeddings", "bos_token_id", "eos_token_id"):
        assert ours[key] == getattr(ref, key), key
    assert math.isclose(ours["rms_norm_eps"], ref.rms_norm_eps, rel_tol=1e-6)


@pytest.mark.slow
def test_smollm2_weights_match_transformers(smollm2_gguf, hf_gguf_state_dict):
    ours = {n: t.materialize() for n, t in iter_weights(ModelSource("gguf", smollm2_gguf))}
    ref = hf_gguf_state_dict
    # Tied: neither side has a separate lm_head tensor worth comparing (HF ties it).
    assert set(ours) == set(ref) - {"lm_head.weight"}
    for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                 "model.layers.0.self_attn.k_proj.weight", "model.layers.7.self_attn.v_proj.weight",
                 "model.layers.29.self_attn.q_proj.weight",
                 "model.layers.29.self_attn.k_proj.weight",
                 "model.layers.3.mlp.down_proj.weight", "model.layers.3.input_layernorm.weight",
                 "model.norm.weight"):
        assert ours[name].dtype == torch.float32
        assert ours[name].shape == ref[name].shape, name
        torch.testing.assert_close(ours[name], ref[name], rtol=0, atol=1e-6, msg=name)


def test_smollm2_truncated_copy_is_rejected(smollm2_gguf, tmp_path):
    data = smollm2_gguf.read_bytes()
    for cut, name in ((len(data) // 2, "half.gguf"), (len(data) - 100, "short.gguf"),
                      (5000, "header.gguf")):
        bad = tmp_path / name
        bad.write_bytes(data[:cut])
        with pytest.raises(ModelLoadError, match="truncated") as e:
            load_model_config(ModelSource("gguf", bad))
        assert str(bad) in str(e.value)


# --- tiny synthetic GGUFs -----------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_roundtrip(make_tiny_gguf, arch):
    extra = {"head_dim": 32} if arch == "qwen3" else {}
    model, path = make_tiny_gguf(arch, **extra)
    cfg = load_model_config(ModelSource("gguf", path))
    assert cfg.architecture == type(model).__name__
    mc = model.config
    want_head_dim = getattr(mc, "head_dim", None) or mc.hidden_size // mc.num_attention_heads
    assert cfg.head_dim == want_head_dim and cfg.num_kv_heads == 2
    assert cfg.get("tie_word_embeddings") == model.config.tie_word_embeddings
    ours = {n: t.materialize() for n, t in iter_gguf_weights(path)}
    ref = model.state_dict()
    if model.config.tie_word_embeddings:
        ref = {k: v for k, v in ref.items() if k != "lm_head.weight"}
    assert set(ours) == set(ref)
    for name, t in ref.items():
        torch.testing.assert_close(ours[name], t.float(), rtol=0, atol=0, msg=name)


def test_tiny_quantized_tensor(make_tiny_gguf):
    q = gguf.GGMLQuantizationType.Q8_0
    name = "model.layers.1.self_attn.k_proj.weight"
    model, path = make_tiny_gguf("llama", quant={name: q, "model.layers.0.mlp.up_proj.weight": q})
    ours = {n: t.materialize() for n, t in iter_gguf_weights(path)}
    for n in (name, "model.layers.0.mlp.up_proj.weight"):
        ref = model.state_dict()[n]
        assert ours[n].shape == ref.shape
        torch.testing.assert_close(ours[n], ref, rtol=0, atol=0.02)


def test_unpermute_inverts_llama_cpp_permute(llama_permute):
    w = np.arange(8 * 16 * 3, dtype=np.float32).reshape(8 * 16, 3)
    back = unpermute_qk(torch.from_numpy(llama_permute(w, 8)), 8)
    assert torch.equal(back, torch.from_numpy(w))


def test_tensor_names():
    arch = get_arch("llama")
    assert hf_tensor_name("token_embd.weight", arch) == "model.embed_tokens.weight"
    assert (hf_tensor_name("blk.12.attn_output.weight", arch)
            == "model.layers.12.self_attn.o_proj.weight")
    assert (hf_tensor_name("blk.0.ffn_norm.weight", arch)
            == "model.layers.0.post_attention_layernorm.weight")
    assert hf_tensor_name("blk.3.attn_q.bias", arch) == "model.layers.3.self_attn.q_proj.bias"
    assert hf_tensor_name("output.weight", arch) == "lm_head.weight"
    assert hf_tensor_name("rope_freqs.weight", arch) is None
    with pytest.raises(ModelLoadError, match="blk.0.ssm_x.weight"):
        hf_tensor_name("blk.0.ssm_x.weight", arch)


def test_unsupported_arch(gguf_writer, tmp_path):
    path = gguf_writer(tmp_path / "m.gguf", "mamba", {"mamba.block_count": 1},
                       {"token_embd.weight": (np.zeros((4, 8), np.float32), None)})
    with pytest.raises(ModelLoadError, match="'mamba' is not supported.*llama"):
        load_model_config(ModelSource("gguf", path))


def test_missing_required_metadata(gguf_writer, tmp_path):
    path = gguf_writer(tmp_path / "m.gguf", "llama", {"llama.block_count": 1},
                       {"token_embd.weight": (np.zeros((4, 8), np.float32), None)})
    with pytest.raises(ModelLoadError, match="llama.embedding_length"):
        load_model_config(ModelSource("gguf", path))


def test_rope_scaling_keys(make_tiny_gguf):
    _, path = make_tiny_gguf("llama", extra_kv={
        "llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0,
        "llama.rope.scaling.original_context_length": 64})
    rs = gguf_config(path)["rope_scaling"]
    assert rs == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}


def test_llama3_rope_freqs_become_rope_scaling(make_tiny_gguf, gguf_writer, tmp_path):
    # rope_freqs as llama.cpp's converter computes it for Llama 3.1 (factor 8, low 1, high 4).
    dim, base, orig = 16, 500000.0, 8192
    freqs = 1.0 / base ** (np.arange(0, dim, 2, dtype=np.float32) / dim)
    factors = []
    for f in freqs:
        wl = 2 * math.pi / f
        if wl < orig / 4:
            factors.append(1.0)
        elif wl > orig / 1:
            factors.append(8.0)
        else:
            s = (orig / wl - 1) / (4 - 1)
            factors.append(1 / ((1 - s) / 8 + s))
    model, src = make_tiny_gguf("llama", extra_kv={})
    reader = gguf.GGUFReader(src)
    kv = {k: f.contents() for k, f in reader.fields.items()
          if not k.startswith(("GGUF.", "general.architecture"))}
    kv["llama.rope.freq_base"] = base
    tensors = {t.name: (np.array(t.data), None) for t in reader.tensors}
    tensors["rope_freqs.weight"] = (np.array(factors, dtype=np.float32), None)
    path = gguf_writer(tmp_path / "l3.gguf", "llama", kv, tensors)
    rs = gguf_config(path)["rope_scaling"]
    assert rs == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    assert "rope_freqs.weight" not in dict(iter_gguf_weights(path))


# --- bad files ----------------------------------------------------------------------------


def test_garbage_and_missing_files(tmp_path):
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"this is not a gguf file at all" * 10)
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        open_gguf(garbage)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        open_gguf(empty)
    with pytest.raises(ModelLoadError, match="does not exist"):
        open_gguf(tmp_path / "nope.gguf")


def test_truncated_tiny_gguf(make_tiny_gguf, tmp_path):
    _, path = make_tiny_gguf("llama")
    data = path.read_bytes()
    for cut in (len(data) - 1, len(data) // 2, 40):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(ModelLoadError, match="truncated"):
            list(iter_gguf_weights(bad))


def test_reader_cache_notices_file_change(make_tiny_gguf, tmp_path):
    _, path = make_tiny_gguf("llama")
    assert open_gguf(path) is open_gguf(path)
    copy = tmp_path / "copy.gguf"
    shutil.copy(path, copy)
    assert open_gguf(copy) is not open_gguf(path)

"""HF folders: config.json, generation_config.json, single and sharded safetensors."""

from __future__ import annotations

import json
import struct

import pytest
import torch

from cvllm.loader import (ModelLoadError, ModelSource, generation_defaults, iter_weights,
                          load_model_config)
from cvllm.loader.hf_config import normalize_rope
from cvllm.loader.safetensors_loader import read_safetensors_header


def _reference(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).state_dict()


def _assert_same_state_dict(folder):
    ours = {n: t.materialize() for n, t in iter_weights(ModelSource("hf", folder))}
    ref = _reference(folder)
    assert set(ours) == set(ref)
    for name, t in ref.items():
        assert torch.equal(ours[name], t), name


def test_single_file(tiny_llama_dir):
    folder = tiny_llama_dir()
    assert (folder / "model.safetensors").is_file()
    cfg = load_model_config(ModelSource("hf", folder), dtype="bf16")
    assert cfg.architecture == "LlamaForCausalLM" and cfg.dtype == "bf16"
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (2, 4, 2, 16)
    assert cfg.vocab_size == 128 and cfg.max_model_len == 256
    assert cfg.eos_token_ids == [2] and cfg.bos_token_id == 1
    # transformers 5 writes rope_parameters; the loader adds the classic spellings.
    assert cfg.get("rope_theta") == 10000.0 and cfg.get("rope_scaling") is None
    _assert_same_state_dict(folder)


def test_sharded(tiny_llama_dir):
    folder = tiny_llama_dir(max_shard_size="50KB")
    assert (folder / "model.safetensors.index.json").is_file()
    assert len(list(folder.glob("*.safetensors"))) > 2
    _assert_same_state_dict(folder)


def test_bf16_weights_keep_their_dtype(tiny_llama_dir):
    folder = tiny_llama_dir(dtype=torch.bfloat16)
    dtypes = {t.dtype for _, t in iter_weights(ModelSource("hf", folder))}
    assert dtypes == {torch.bfloat16}


def test_missing_shard(tiny_llama_dir):
    folder = tiny_llama_dir(max_shard_size="50KB")
    victim = sorted(folder.glob("*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(ModelLoadError, match=f"missing 1 of .*{victim.name}"):
        list(iter_weights(ModelSource("hf", folder)))


def test_truncated_shard(tiny_llama_dir):
    folder = tiny_llama_dir(max_shard_size="50KB")
    victim = sorted(folder.glob("*.safetensors"))[-1]
    data = victim.read_bytes()
    victim.write_bytes(data[:-10])
    with pytest.raises(ModelLoadError, match="truncated") as e:
        list(iter_weights(ModelSource("hf", folder)))
    assert victim.name in str(e.value)
    victim.write_bytes(data[:6])
    with pytest.raises(ModelLoadError, match="too short"):
        list(iter_weights(ModelSource("hf", folder)))


def test_bad_headers(tmp_path):
    huge = tmp_path / "huge.safetensors"
    huge.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(ModelLoadError, match="header length"):
        read_safetensors_header(huge)
    notjson = tmp_path / "notjson.safetensors"
    notjson.write_bytes(struct.pack("<Q", 4) + b"{{{{")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        read_safetensors_header(notjson)
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}}).encode()
    wrong = tmp_path / "wrong.safetensors"
    wrong.write_bytes(struct.pack("<Q", len(header)) + header + bytes(12))
    with pytest.raises(ModelLoadError, match="does not fill"):
        read_safetensors_header(wrong)


def test_index_names_tensor_missing_from_shard(tiny_llama_dir):
    folder = tiny_llama_dir(max_shard_size="50KB")
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    first_shard = next(iter(index["weight_map"].values()))
    index["weight_map"]["model.layers.9.mlp.up_proj.weight"] = first_shard
    index_path.write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match="incomplete"):
        list(iter_weights(ModelSource("hf", folder)))


def test_bad_config(tiny_llama_dir):
    folder = tiny_llama_dir()
    (folder / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="config.json is not valid JSON"):
        load_model_config(ModelSource("hf", folder))
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ModelLoadError, match="hidden_size"):
        load_model_config(ModelSource("hf", folder))
    (folder / "config.json").write_text(json.dumps({"hidden_size": 4}))
    with pytest.raises(ModelLoadError, match="architectures"):
        load_model_config(ModelSource("hf", folder))
    (folder / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model_config(ModelSource("hf", folder))


def test_no_safetensors(tiny_llama_dir):
    folder = tiny_llama_dir()
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="no \\*.safetensors.*only .safetensors"):
        list(iter_weights(ModelSource("hf", folder)))


def test_generation_config(tiny_llama_dir):
    folder = tiny_llama_dir()
    (folder / "generation_config.json").write_text(json.dumps({
        "eos_token_id": [7, 2], "bos_token_id": 1, "temperature": 0.6, "top_p": 0.9,
        "top_k": 20, "do_sample": True, "max_length": 99}))
    cfg = load_model_config(ModelSource("hf", folder))
    assert cfg.eos_token_ids == [7, 2]  # generation_config first, config.json's 2 merged in
    assert generation_defaults(ModelSource("hf", folder)) == {
        "temperature": 0.6, "top_p": 0.9, "top_k": 20}
    (folder / "generation_config.json").unlink()
    assert generation_defaults(ModelSource("hf", folder)) == {}


def test_normalize_rope_dialects():
    old = normalize_rope({"rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert old["rope_scaling"] == {"type": "linear", "rope_type": "linear", "factor": 2.0}
    assert old["rope_parameters"]["rope_theta"] == 5e5
    new = normalize_rope(
        {"rope_parameters": {"rope_theta": 1e6, "rope_type": "yarn", "factor": 4.0}})
    assert new["rope_theta"] == 1e6 and new["rope_scaling"] == {"rope_type": "yarn", "factor": 4.0}
    assert normalize_rope({})["rope_scaling"] is None

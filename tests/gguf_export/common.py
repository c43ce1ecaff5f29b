"""Shared pieces of the test GGUF writers: typed metadata, tensor writing, name mapping.

Each architecture module (``tests/gguf_export/<arch>.py``) provides
``export(hf_model, path) -> Path`` writing F32 tensors the way llama.cpp's
``convert_hf_to_gguf.py`` names and transforms them, with the metadata keys its
``gguf-py`` constants define. Written independently of llama.cpp's code.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

import numpy as np
import torch

TensorMap = Dict[str, Tuple[np.ndarray, Any]]


def write_gguf(path: Path, arch: str, kv: Dict[str, Any], tensors: Mapping[str, Any]) -> Path:
    """Write a GGUF file. Metadata values are typed by Python type (bool, int -> uint32,
    float -> float32, str, list -> array); wrap a value as ``("i32", v)``/``("f32", v)``/
    ``("u64", v)`` to force a type. ``tensors`` maps names to arrays or (array, qtype)."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    for key, val in kv.items():
        _add_kv(w, key, val)
    for name, item in tensors.items():
        arr, qtype = item if isinstance(item, tuple) else (item, None)
        if qtype is None:
            w.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float32))
        else:
            w.add_tensor(name, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


def _add_kv(w, key: str, val: Any) -> None:
    if isinstance(val, tuple) and len(val) == 2 and isinstance(val[0], str):
        kind, v = val
        {"i32": w.add_int32, "f32": w.add_float32, "u64": w.add_uint64, "u32": w.add_uint32}[kind](key, v)
    elif isinstance(val, bool):
        w.add_bool(key, val)
    elif isinstance(val, int):
        w.add_uint32(key, val)
    elif isinstance(val, float):
        w.add_float32(key, val)
    elif isinstance(val, str):
        w.add_string(key, val)
    else:
        w.add_array(key, list(val))


# HF decoder-layer suffix -> llama.cpp tensor stem, the names most architectures share.
COMMON_LAYER_NAMES: Dict[str, str] = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
COMMON_TOP_NAMES: Dict[str, str] = {"model.embed_tokens": "token_embd", "model.norm": "output_norm",
                                    "lm_head": "output"}


def gguf_tensor_name(hf_name: str, layer_names: Mapping[str, str] = COMMON_LAYER_NAMES,
                     top_names: Mapping[str, str] = COMMON_TOP_NAMES) -> str:
    """``model.layers.3.self_attn.q_proj.weight`` -> ``blk.3.attn_q.weight``."""
    stem, suffix = hf_name.rsplit(".", 1)
    if stem in top_names:
        return f"{top_names[stem]}.{suffix}"
    parts = stem.split(".")
    if parts[0] == "model" and parts[1] == "layers":
        layer, rest = parts[2], ".".join(parts[3:])
        if rest not in layer_names:
            raise KeyError(f"no GGUF name for {hf_name!r} (add {rest!r} to the arch's map)")
        return f"blk.{layer}.{layer_names[rest]}.{suffix}"
    raise KeyError(f"no GGUF name for {hf_name!r}")


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """The Q/K row interleave llama.cpp's converter applies for llama-style rope."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def state_tensors(model: torch.nn.Module, name_fn: Callable[[str], Optional[str]],
                  transform: Optional[Callable[[str, np.ndarray], np.ndarray]] = None) -> Dict[str, np.ndarray]:
    """The model's tensors under GGUF names (``name_fn`` returns None to drop one)."""
    out: Dict[str, np.ndarray] = {}
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and tied:
            continue
        gname = name_fn(name)
        if gname is None:
            continue
        arr = t.detach().float().numpy().copy()
        out[gname] = transform(name, arr) if transform else arr
    return out


def base_kv(arch: str, cfg: Any, rope_theta: Optional[float] = None) -> Dict[str, Any]:
    """Keys nearly every llama.cpp text architecture writes."""
    p = arch + "."
    kv: Dict[str, Any] = {
        p + "context_length": int(cfg.max_position_embeddings),
        p + "embedding_length": int(cfg.hidden_size),
        p + "block_count": int(cfg.num_hidden_layers),
        p + "attention.head_count": int(cfg.num_attention_heads),
        p + "attention.head_count_kv": int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads),
        "general.file_type": 0,
        "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
    }
    if getattr(cfg, "intermediate_size", None):
        kv[p + "feed_forward_length"] = int(cfg.intermediate_size)
    theta = rope_theta
    if theta is None:
        rp = getattr(cfg, "rope_parameters", None) or {}
        theta = rp.get("rope_theta", getattr(cfg, "rope_theta", None))
    if theta is not None:
        kv[p + "rope.freq_base"] = float(theta)
    return kv

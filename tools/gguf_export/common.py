"""Shared pieces of the GGUF writers: typed metadata, tensor writing, name mapping, and
the choice of each tensor's GGML type when a quantized file is asked for.

Each architecture module (``tools/gguf_export/<arch>.py``) provides
``export(hf_model, path, plan=None) -> Path`` writing the tensors the way llama.cpp's
``convert_hf_to_gguf.py`` names and transforms them, with the metadata keys its
``gguf-py`` constants define: F32 by default, or the types a ``QuantPlan`` picks, blocks
made by cvllm's quantizer (``cvllm.quantization.ggml_quantizer``). Written independently of
llama.cpp's code. Used by ``tools/write_gguf.py`` and by the tests, which build tiny GGUF
files from tiny transformers models; cvllm itself never imports ``tools/``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

import numpy as np
import torch

TensorMap = Dict[str, Tuple[np.ndarray, Any]]

# When a row is not whole K-quant super-blocks (256), llama-quantize falls back to a type
# with 32-element blocks of about the same precision; IQ4_NL, its choice for Q2_K / Q3_K,
# has no cvllm quantizer, so Q4_0 (the same 4.5 bits) stands in.
FALLBACK_TYPES: Dict[str, str] = {"Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0",
                                  "Q5_K": "Q5_1", "Q6_K": "Q8_0"}

# general.file_type of a file whose weights are all one type (the "_S" mixes for K-quants).
FILE_TYPES: Dict[str, str] = {"F32": "ALL_F32", "F16": "MOSTLY_F16", "BF16": "MOSTLY_BF16",
                              "Q4_0": "MOSTLY_Q4_0", "Q4_1": "MOSTLY_Q4_1",
                              "Q5_0": "MOSTLY_Q5_0", "Q5_1": "MOSTLY_Q5_1",
                              "Q8_0": "MOSTLY_Q8_0", "Q2_K": "MOSTLY_Q2_K",
                              "Q3_K": "MOSTLY_Q3_K_S", "Q4_K": "MOSTLY_Q4_K_S",
                              "Q5_K": "MOSTLY_Q5_K_S", "Q6_K": "MOSTLY_Q6_K"}


@dataclass(frozen=True)
class QuantPlan:
    """Which GGML type each tensor of an export is written as (built by the caller, e.g.
    ``tools/write_gguf.py``; no plan means every tensor F32, as the tests' files are)."""

    weights: str
    """Type name (``gguf.GGMLQuantizationType``) of the weight matrices: ``Q4_K``, ``F16``..."""
    overrides: Mapping[str, str] = field(default_factory=dict)
    """GGUF tensor name -> type name, e.g. ``{"token_embd.weight": "Q8_0"}``."""
    device: str = "cpu"
    """Where cvllm's quantizer runs."""

    def type_for(self, name: str, shape: Tuple[int, ...]) -> str:
        """Like llama-quantize: weights of two or more dims are quantized along the last
        dim (each expert's rows of an ``[E, out, in]`` stack alike); vectors, norms and
        MoE routers stay F32; a row that is not whole blocks falls back to a type with
        32-element blocks (``FALLBACK_TYPES``), and to F32 when not even that fits."""
        import gguf

        if len(shape) < 2 or not name.endswith(".weight") or "norm.weight" in name \
                or "ffn_gate_inp" in name:
            return "F32"
        wanted = self.overrides.get(name, self.weights)
        for candidate in (wanted, FALLBACK_TYPES.get(wanted)):
            if candidate is not None:
                block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[candidate]][0]
                if shape[-1] % block == 0:
                    return candidate
        return "F32"


def write_gguf(path: Path, arch: str, kv: Dict[str, Any], tensors: Mapping[str, Any],
               plan: Optional[QuantPlan] = None) -> Path:
    """Write a GGUF file. Metadata values are typed by Python type (bool, int -> uint32,
    float -> float32, str, list -> array); wrap a value as ``("i32", v)``/``("f32", v)``/
    ``("u64", v)`` to force a type. ``tensors`` maps names to arrays or (array, qtype), the
    latter quantized by gguf-py; with a ``plan`` the plain arrays take the plan's types and
    ``general.file_type`` / ``general.quantization_version`` say so."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    if plan is not None:
        kv = dict(kv, **{"general.file_type": int(gguf.LlamaFileType[FILE_TYPES[plan.weights]])})
        if plan.weights not in ("F32", "F16", "BF16"):
            kv["general.quantization_version"] = gguf.GGML_QUANT_VERSION
    for key, val in kv.items():
        _add_kv(w, key, val)
    for name, item in tensors.items():
        arr, qtype = item if isinstance(item, tuple) else (item, None)
        if qtype is not None:
            w.add_tensor(name, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
        elif plan is None:
            w.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float32))
        else:
            _add_planned(w, name, np.asarray(arr), plan)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


def _add_planned(w, name: str, arr: np.ndarray, plan: QuantPlan) -> None:
    """Add one tensor as the type ``plan`` picks for it: floats by numpy / gguf-py, block
    types by cvllm's quantizer (rows along the last dim, leading dims kept)."""
    import gguf

    kind = plan.type_for(name, arr.shape)
    qtype = gguf.GGMLQuantizationType[kind]
    if kind == "F32":
        w.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float32))
    elif kind == "F16":
        w.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float16))
    elif kind == "BF16":
        w.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(arr, np.float32), qtype),
                     raw_dtype=qtype)
    else:
        from cvllm.quantization.ggml_quantizer import quantize

        weights = torch.from_numpy(np.ascontiguousarray(arr, np.float32)).to(plan.device)
        blocks = quantize(weights, int(qtype)).cpu().numpy()  # uint8 [..., K // B * S]
        w.add_tensor(name, blocks, raw_dtype=qtype)


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

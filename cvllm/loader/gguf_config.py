"""GGUF metadata -> a Hugging Face style config dict (what config.json would hold).

Built by ``load_model_config`` for GGUF sources; the result goes through the same rope
normalisation as config.json so model code reads one spelling. Metadata values are type-
and range-checked here because they size every tensor the model later allocates.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Dict, List, Optional

import numpy as np

from .errors import ModelLoadError
from .gguf_names import GGUFArch, get_arch
from .hf_config import normalize_rope

logger = logging.getLogger("cvllm.loader")

_MISSING = object()
# Sanity bound for any size read from metadata (layers, heads, widths, context).
_MAX_DIM = 1 << 31


def meta(reader: Any, key: str, default: Any = _MISSING) -> Any:
    """A metadata value as a Python object (str, int, float, bool or list)."""
    field = reader.fields.get(key)
    if field is None:
        if default is _MISSING:
            raise ModelLoadError(f"GGUF metadata has no {key!r}")
        return default
    try:
        return field.contents()
    except (ValueError, IndexError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"GGUF metadata {key!r} is unreadable: {e}") from e


def _dim(reader: Any, key: str, default: Any = _MISSING) -> Any:
    """A positive size from metadata; a per-layer list is accepted only when uniform."""
    v = meta(reader, key, default)
    if v is default and default is not _MISSING:
        return v
    if isinstance(v, list):
        if not v or len(set(v)) != 1:
            raise ModelLoadError(f"GGUF {key!r} varies per layer ({v[:8]}...); not supported")
        v = v[0]
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 0 < v < _MAX_DIM:
        raise ModelLoadError(f"GGUF metadata {key!r} must be a positive integer, got {v!r}")
    return int(v)


def _float(reader: Any, key: str, default: Any = None) -> Optional[float]:
    v = meta(reader, key, default)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ModelLoadError(f"GGUF metadata {key!r} must be a number, got {v!r}")
    if isinstance(v, float) and float(np.float32(v)) == v:
        # A float32 value: use its shortest decimal (1e-05, not 9.999999747378752e-06),
        # as config.json would spell it.
        return float(str(np.float32(v)))
    return float(v)


def gguf_architecture(reader: Any) -> str:
    arch = meta(reader, "general.architecture")
    if not isinstance(arch, str):
        raise ModelLoadError(f"GGUF general.architecture must be a string, got {arch!r}")
    return arch


def gguf_to_hf_config(reader: Any) -> Dict[str, Any]:
    """HF config dict for the model in ``reader`` (a ``gguf.GGUFReader``)."""
    name = gguf_architecture(reader)
    arch = get_arch(name)
    p = name + "."
    hidden = _dim(reader, p + "embedding_length")
    heads = _dim(reader, p + "attention.head_count")
    cfg: Dict[str, Any] = {"architectures": [arch.hf_architecture], "model_type": arch.model_type}
    cfg.update(arch.fixed_config)
    cfg.update(
        hidden_size=hidden,
        intermediate_size=_dim(reader, p + "feed_forward_length"),
        num_hidden_layers=_dim(reader, p + "block_count"),
        num_attention_heads=heads,
        num_key_value_heads=_dim(reader, p + "attention.head_count_kv", heads),
        head_dim=_head_dim(reader, p, arch, hidden, heads),
        rms_norm_eps=_float(reader, p + "attention.layer_norm_rms_epsilon", 1e-5),
        rope_theta=_float(reader, p + "rope.freq_base", 10000.0),
        vocab_size=_vocab_size(reader, p),
    )
    ctx = _dim(reader, p + "context_length", None)
    if ctx is not None:
        cfg["max_position_embeddings"] = ctx
    tensor_names = {t.name for t in reader.tensors}
    # llama.cpp ties embeddings by simply not writing output.weight.
    cfg["tie_word_embeddings"] = "output.weight" not in tensor_names
    cfg["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
    cfg["mlp_bias"] = "blk.0.ffn_up.bias" in tensor_names
    cfg.update(_special_tokens(reader))
    cfg["rope_scaling"] = _rope_scaling(reader, p, cfg)
    return normalize_rope(cfg)


def _head_dim(reader: Any, p: str, arch: GGUFArch, hidden: int, heads: int) -> int:
    hd = _dim(reader, p + "attention.key_length", None)
    if hd is None and arch.head_dim_from_rope:
        hd = _dim(reader, p + "rope.dimension_count", None)
    if hd is None:
        if hidden % heads:
            raise ModelLoadError(f"hidden size {hidden} is not a multiple of {heads} heads "
                                 "and the GGUF gives no attention.key_length")
        hd = hidden // heads
    return hd


def _vocab_size(reader: Any, p: str) -> int:
    emb = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    # GGUF dims are innermost first: token_embd is [hidden, vocab].
    emb_rows = int(emb.shape[-1]) if emb is not None and len(emb.shape) == 2 else None
    v = _dim(reader, p + "vocab_size", None)
    if v is None:
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        v = emb_rows if emb_rows is not None else (len(tokens.data) if tokens else None)
    if v is None:
        raise ModelLoadError("GGUF gives no vocab size (no vocab_size key, tokens or token_embd)")
    if emb_rows is not None and emb_rows != v:
        raise ModelLoadError(f"GGUF vocab_size {v} does not match token_embd rows {emb_rows}")
    return v


def _special_tokens(reader: Any) -> Dict[str, int]:
    out = {}
    for hf_key, key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                        ("pad_token_id", "padding_token_id")):
        v = meta(reader, "tokenizer.ggml." + key, None)
        if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
            out[hf_key] = v
    return out


def gguf_eos_token_ids(reader: Any) -> List[int]:
    """eos plus end-of-turn / end-of-message ids: all of them end a chat reply."""
    ids: List[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        v = meta(reader, "tokenizer.ggml." + key, None)
        if isinstance(v, int) and not isinstance(v, bool) and v >= 0 and v not in ids:
            ids.append(v)
    return ids


def _rope_scaling(reader: Any, p: str, cfg: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    kind = meta(reader, p + "rope.scaling.type", None)
    factor = _float(reader, p + "rope.scaling.factor")
    if kind is None and _float(reader, p + "rope.scale_linear") is not None:
        kind, factor = "linear", _float(reader, p + "rope.scale_linear")
    if kind in (None, "none"):
        return _llama3_from_rope_freqs(reader, cfg)
    if not isinstance(kind, str) or factor is None:
        raise ModelLoadError(f"GGUF rope scaling {kind!r} without a factor is not understood")
    out: Dict[str, Any] = {"rope_type": kind, "factor": factor}
    orig = _dim(reader, p + "rope.scaling.original_context_length", None)
    if orig is not None:
        out["original_max_position_embeddings"] = orig
    for key, hf in (("rope.scaling.attn_factor", "attention_factor"),
                    ("rope.scaling.yarn_beta_fast", "beta_fast"),
                    ("rope.scaling.yarn_beta_slow", "beta_slow")):
        v = _float(reader, p + key)
        if v is not None:
            out[hf] = v
    return out


def _llama3_from_rope_freqs(reader: Any, cfg: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """Llama 3.1+ GGUFs store llama3 rope scaling as a precomputed per-frequency divisor
    tensor, not as metadata; find the llama3 parameters that reproduce it."""
    t = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if t is None:
        return None
    got = np.asarray(t.data, dtype=np.float64).reshape(-1)
    dim = cfg["head_dim"]
    if got.size != dim // 2:
        raise ModelLoadError(f"rope_freqs has {got.size} values, expected head_dim/2 = {dim // 2}")
    freqs = 1.0 / cfg["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    wavelen = 2 * math.pi / freqs
    factor = float(got.max())
    for orig in (8192, 4096, 2048, 16384, 32768, 131072):
        for low, high in ((1.0, 4.0), (1.0, 2.0), (2.0, 4.0), (1.0, 8.0)):
            smooth = np.clip((orig / wavelen - low) / (high - low), 0.0, 1.0)
            want = 1.0 / ((1 - smooth) / factor + smooth)
            if np.allclose(want, got, rtol=1e-3, atol=1e-4):
                return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                        "high_freq_factor": high, "original_max_position_embeddings": orig}
    logger.warning("GGUF rope_freqs does not match llama3 rope scaling; ignoring it "
                   "(outputs on long contexts may differ from llama.cpp)")
    return None

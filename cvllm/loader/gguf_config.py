"""GGUF metadata -> a Hugging Face style config dict (what config.json would hold).

Built by ``load_model_config`` for GGUF sources; the result goes through the same rope
normalisation as config.json so model code reads one spelling. Metadata values are type-
and range-checked here because they size every tensor the model later allocates.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable, Dict, List, Optional

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


# Per-arch integer metadata (key after ``<arch>.``) -> HF config key, read when present.
ARCH_INT_KEYS: Dict[str, Dict[str, str]] = {
    "qwen2moe": {"expert_count": "num_experts", "expert_used_count": "num_experts_per_tok",
                 "expert_feed_forward_length": "moe_intermediate_size",
                 "expert_shared_feed_forward_length": "shared_expert_intermediate_size"},
    "qwen3moe": {"expert_count": "num_experts", "expert_used_count": "num_experts_per_tok",
                 "expert_feed_forward_length": "moe_intermediate_size"},
}


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
    for key, hf_key in ARCH_INT_KEYS.get(name, {}).items():
        v = _dim(reader, p + key, None)
        if v is not None:
            cfg[hf_key] = v
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
    arch_config = ARCH_CONFIG.get(name)
    if arch_config is not None:
        cfg.update(arch_config(reader, p, cfg))
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


def _gemma_config(reader: Any, p: str, cfg: Dict[str, Any]) -> Dict[str, Any]:
    """Gemma 2/3 settings: those llama.cpp's converter stores, and those its runtime
    (llama-model.cpp) implies: the sliding pattern (every 2nd / 6th layer global unless
    ``attention.sliding_window_pattern`` says otherwise), Gemma 3's local rope base 10000,
    and the attention scale 1/sqrt(head_dim), except 1/sqrt(hidden/heads) for the 27B
    sizes (46 / 62 layers): HF's ``query_pre_attn_scalar``."""
    gemma2 = p == "gemma2."
    n, hidden, heads = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"]
    is_27b = n == (46 if gemma2 else 62)
    out: Dict[str, Any] = {
        "sliding_window": _dim(reader, p + "attention.sliding_window", 4096 if gemma2 else None),
        "layer_types": _swa_layer_types(reader, p, n, 2 if gemma2 else 6),
        "query_pre_attn_scalar": hidden // heads if is_27b else cfg["head_dim"],
    }
    if gemma2:
        out["final_logit_softcapping"] = _float(reader, p + "final_logit_softcapping", 30.0)
        out["attn_logit_softcapping"] = _float(reader, p + "attn_logit_softcapping", 50.0)
    else:  # llama.cpp's gemma3 has no softcaps
        out["final_logit_softcapping"] = out["attn_logit_softcapping"] = None
        out["rope_local_base_freq"] = _float(reader, p + "rope.freq_base_swa", 10000.0)
    return out


def _swa_layer_types(reader: Any, p: str, n: int, default_period: int) -> List[str]:
    """HF ``layer_types`` from llama.cpp's sliding pattern: a period (layer i slides
    unless i % period == period - 1; 0 = every layer) or one bool per layer."""
    pattern = meta(reader, p + "attention.sliding_window_pattern", default_period)
    if isinstance(pattern, list):
        if len(pattern) != n:
            raise ModelLoadError(f"GGUF sliding_window_pattern has {len(pattern)} entries "
                                 f"for {n} layers")
        sliding = [bool(x) for x in pattern]
    else:
        period = int(pattern)
        sliding = [period == 0 or i % period < period - 1 for i in range(n)]
    return ["sliding_attention" if s else "full_attention" for s in sliding]


def _partial_rotary_config(reader: Any, p: str, cfg: Dict[str, Any]) -> Dict[str, Any]:
    """``partial_rotary_factor`` from ``rope.dimension_count`` (the rotated width) over
    head_dim; llama.cpp stores no factor. GLM-4's converter writes head_dim * 0.5."""
    rot = _dim(reader, p + "rope.dimension_count", None)
    if rot is None or rot == cfg["head_dim"]:
        return {}
    if rot > cfg["head_dim"] or rot % 2:
        raise ModelLoadError(f"GGUF rope.dimension_count {rot} must be even and at most "
                             f"head_dim {cfg['head_dim']}")
    return {"partial_rotary_factor": rot / cfg["head_dim"]}


def _deepseek2_config(reader: Any, p: str, cfg: Dict[str, Any]) -> Dict[str, Any]:
    """DeepSeek V2/V3 from llama.cpp's ``deepseek2``: sigmoid gating (``expert_gating_func``
    2) means V3 (``noaux_tc``), else V2 (softmax; absent in older V2 files). MLA sizes
    from both header styles: current converters view MLA as MQA (``head_count_kv`` 1,
    ``key_length`` R+P, ``value_length`` R) and put the per-head sizes in
    ``key_length_mla`` / ``value_length_mla``; older ones wrote them as key/value_length.
    YaRN's ``mscale_all_dim`` is stored as ``yarn_log_multiplier`` / 0.1, and llama.cpp's
    graph assumes ``mscale`` equal to it (true of every DeepSeek config)."""
    rope_dim = _dim(reader, p + "rope.dimension_count")
    k_len = _dim(reader, p + "attention.key_length_mla", None)
    k_len = k_len or _dim(reader, p + "attention.key_length")
    v_len = _dim(reader, p + "attention.value_length_mla", None)
    v_len = v_len or _dim(reader, p + "attention.value_length")
    if k_len <= rope_dim:
        raise ModelLoadError(f"GGUF deepseek2 key length {k_len} leaves no room beside the "
                             f"rope dimension {rope_dim}")
    v3 = meta(reader, p + "expert_gating_func", 1) == 2
    n_group = _dim(reader, p + "expert_group_count", None)
    names = {t.name for t in reader.tensors}
    out: Dict[str, Any] = {
        "architectures": ["DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v3" if v3 else "deepseek_v2",
        "q_lora_rank": _dim(reader, p + "attention.q_lora_rank", None),
        "kv_lora_rank": _dim(reader, p + "attention.kv_lora_rank"),
        "qk_rope_head_dim": rope_dim, "qk_nope_head_dim": k_len - rope_dim, "v_head_dim": v_len,
        "head_dim": rope_dim, "num_key_value_heads": cfg["num_attention_heads"],
        "first_k_dense_replace": _count(reader, p + "leading_dense_block_count"),
        "n_routed_experts": _dim(reader, p + "expert_count", None),
        "num_experts_per_tok": _dim(reader, p + "expert_used_count", None),
        "moe_intermediate_size": _dim(reader, p + "expert_feed_forward_length", None),
        "n_shared_experts": _count(reader, p + "expert_shared_count"),
        "routed_scaling_factor": _float(reader, p + "expert_weights_scale", 1.0),
        "norm_topk_prob": bool(meta(reader, p + "expert_weights_norm", False)),
        "scoring_func": "sigmoid" if v3 else "softmax",
        "n_group": n_group, "topk_group": _dim(reader, p + "expert_group_used_count", None),
        "topk_method": "noaux_tc" if v3 else (
            "group_limited_greedy" if n_group and n_group > 1 else "greedy"),
        "rope_interleave": True,
        "attention_bias": "blk.0.attn_kv_a_mqa.bias" in names,
        "mlp_bias": any(n.endswith((".ffn_up.bias", ".ffn_up_shexp.bias")) for n in names),
    }
    log_mul = _float(reader, p + "rope.scaling.yarn_log_multiplier")
    if cfg.get("rope_scaling") and log_mul:
        mscale = round(log_mul / 0.1, 6)
        out["rope_scaling"] = dict(cfg["rope_scaling"], mscale=mscale, mscale_all_dim=mscale)
    return out


def _count(reader: Any, key: str) -> int:
    """A non-negative count from metadata (0 when absent)."""
    v = meta(reader, key, 0)
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 0 <= v < _MAX_DIM:
        raise ModelLoadError(f"GGUF metadata {key!r} must be a non-negative integer, got {v!r}")
    return int(v)


def _phi2_config(reader: Any, p: str, cfg: Dict[str, Any]) -> Dict[str, Any]:
    """Phi-2: LayerNorm epsilon and the partial rotary width; llama.cpp's phi2 has no
    qk_layernorm."""
    return {"layer_norm_eps": _float(reader, p + "attention.layer_norm_epsilon", 1e-5),
            "qk_layernorm": False, **_partial_rotary_config(reader, p, cfg)}


def _phi3_config(reader: Any, p: str, cfg: Dict[str, Any]) -> Dict[str, Any]:
    """Phi-3/3.5/4: partial rotary (Phi-4-mini), ``attention.sliding_window`` (0 = none;
    the converter writes 0 for Phi-4), and LongRoPE, which the converter stores as the
    ``rope_factors_long`` / ``rope_factors_short`` tensors plus the original context length
    and the attention factor in metadata (no ``rope.scaling.type``)."""
    out: Dict[str, Any] = _partial_rotary_config(reader, p, cfg)
    window = _count(reader, p + "attention.sliding_window")
    out["sliding_window"] = window or None
    orig = _dim(reader, p + "rope.scaling.original_context_length", None)
    if orig is not None:
        out["original_max_position_embeddings"] = orig
    factors = {t.name: t for t in reader.tensors if t.name.startswith("rope_factors_")}
    if not factors:
        return out
    rot = int(cfg["head_dim"] * out.get("partial_rotary_factor", 1.0))
    lists = {}
    for kind in ("long", "short"):
        t = factors.get(f"rope_factors_{kind}.weight")
        values = None if t is None else np.asarray(t.data, dtype=np.float64).reshape(-1)
        got = None if values is None else values.size
        if got != rot // 2:
            raise ModelLoadError(f"GGUF phi3 rope_factors_{kind} must hold rotary_dim / 2 = "
                                 f"{rot // 2} values, got {got}")
        lists[kind] = [float(np.float32(v)) for v in values]
    if orig is None:
        raise ModelLoadError("GGUF phi3 has rope factors but no "
                             "rope.scaling.original_context_length")
    out["rope_scaling"] = {"rope_type": "longrope", "long_factor": lists["long"],
                           "short_factor": lists["short"],
                           "original_max_position_embeddings": orig}
    attn_factor = _float(reader, p + "rope.scaling.attn_factor")
    if attn_factor is not None:
        out["rope_scaling"]["attention_factor"] = attn_factor
    return out


def _stablelm_config(reader: Any, p: str, cfg: Dict[str, Any]) -> Dict[str, Any]:
    """StableLM: LayerNorm epsilon, partial rotary, and the switches llama.cpp keeps as
    tensors (q/k/v biases, per-head q/k norms) or as ``use_parallel_residual`` (older files
    lack it: no ffn_norm then means parallel, as transformers' GGUF loader reads it)."""
    names = {t.name for t in reader.tensors}
    parallel = meta(reader, p + "use_parallel_residual", "blk.0.ffn_norm.weight" not in names)
    return {"layer_norm_eps": _float(reader, p + "attention.layer_norm_epsilon", 1e-5),
            "use_parallel_residual": bool(parallel),
            "use_qkv_bias": "blk.0.attn_q.bias" in names,
            "qk_layernorm": "blk.0.attn_q_norm.weight" in names,
            **_partial_rotary_config(reader, p, cfg)}


# general.architecture -> the HF config keys only that family has.
ARCH_CONFIG: Dict[str, Callable[[Any, str, Dict[str, Any]], Dict[str, Any]]] = {
    "gemma2": _gemma_config,
    "gemma3": _gemma_config,
    "glm4": _partial_rotary_config,
    "phi2": _phi2_config,
    "phi3": _phi3_config,
    "stablelm": _stablelm_config,
    "deepseek2": _deepseek2_config,
}

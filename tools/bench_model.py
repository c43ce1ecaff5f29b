"""Model shapes for the benchmarks, and the byte / FLOP arithmetic of their ceilings.

Used by ``tools/bench.py`` (and ``tools/bench_hf_peer.py`` reads the folder it writes);
never imported by ``cvllm``. ``write_model_folder`` writes a Hugging Face folder with a
config.json and a tokenizer made on the fly (a WordLevel vocabulary ``t0 .. t{V-1}`` that
covers every token id, so detokenizing random ids works), and no weights: the engine
runs it with ``load_format="dummy"``. The GPU machines have no ``gguf`` package, so the
default model's GGUF tokenizer is no option there. ``python tools/bench_model.py DIR``
writes the 8B folder for ``cvllm serve --w DIR --load-format dummy`` (``bench_serving.py``).

The ceilings (``model_costs``):

- weight bytes a decode step reads: every parameter except an untied input embedding
  table (a step reads only B rows of it; a tied table is read whole by the LM head);
- KV bytes per token: from the engine's allocated cache (or from the config);
- prefill FLOPs: 2 x (matmul parameters, less embedding and LM head) x tokens
  + 2 x LM head x sequences (only each sequence's last row is projected)
  + causal attention 2 x H x D x L(L+1) per layer and sequence (QK^T and PV, half each).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Dict, Optional

# Llama 3.1 8B's config.json (the architecture fields; no weights are ever read).
LLAMA31_8B: Dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 128256,
}

# The same family, small enough for a CPU smoke run in seconds.
TINY_OVERRIDES = {"hidden_size": 64, "head_dim": 16, "intermediate_size": 128,
                  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                  "vocab_size": 512, "max_position_embeddings": 4096, "bos_token_id": 1,
                  "eos_token_id": 2, "torch_dtype": "float32",
                  "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 512,
                                   "rope_type": "llama3"}}

# --hidden / --layers / ... flags -> config.json keys.
SHAPE_FLAGS = {"hidden": "hidden_size", "layers": "num_hidden_layers",
               "heads": "num_attention_heads", "kv_heads": "num_key_value_heads",
               "intermediate": "intermediate_size", "vocab": "vocab_size", "head_dim": "head_dim"}


def build_config(config_path: Optional[str] = None, tiny: bool = False,
                 overrides: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """The 8B Llama 3.1 shape, or a config.json given, or the tiny shape; then overrides."""
    if config_path:
        with open(config_path) as f:
            cfg = json.load(f)
    else:
        cfg = copy.deepcopy(LLAMA31_8B)
        if tiny:
            cfg.update(copy.deepcopy(TINY_OVERRIDES))
    for key, value in (overrides or {}).items():
        if value is not None:
            cfg[key] = value
    given = {k for k, v in (overrides or {}).items() if v is not None}
    if given & {"hidden_size", "num_attention_heads"} and "head_dim" not in given:
        cfg["head_dim"] = int(cfg["hidden_size"]) // int(cfg["num_attention_heads"])
    if not cfg.get("architectures"):
        raise ValueError("the config has no 'architectures' entry")
    return cfg


def special_ids(cfg: Dict[str, Any]) -> Dict[str, int]:
    """bos / eos ids inside the vocabulary (the first eos of a list)."""
    vocab = int(cfg["vocab_size"])
    eos = cfg.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) and eos else eos
    bos = cfg.get("bos_token_id")
    return {"bos": int(bos) if isinstance(bos, int) and 0 <= bos < vocab else 0,
            "eos": int(eos) if isinstance(eos, int) and 0 <= eos < vocab else vocab - 1}


def write_model_folder(folder: Path, cfg: Dict[str, Any]) -> Path:
    """config.json + a fast tokenizer covering ids 0..vocab-1; no weight files."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    ids = special_ids(cfg)
    cfg = dict(cfg, bos_token_id=ids["bos"])
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    vocab = {f"t{i}": i for i in range(int(cfg["vocab_size"]))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=f"t{ids['bos']}",
                                   eos_token=f"t{ids['eos']}", unk_token="t0")
    fast.save_pretrained(str(folder))
    return folder


def write_random_weights(folder: Path, seed: int = 0, std: float = 0.02,
                         shard_bytes: int = 2 << 30) -> Path:
    """Random weights for the folder's config.json as safetensors shards (bf16, or the
    config's ``torch_dtype`` when float32): norm weights 1, biases 0, every other tensor
    N(0, std), each from its own generator seeded by ``(seed, its name)``. Unlike
    ``--load-format dummy`` (each rank draws its own shard, so TP sizes load different
    models), every tensor parallel size then loads the same model through the real
    loader, which is what comparing their outputs needs. Names and shapes come from
    transformers' own model of the config, built on the meta device (no memory); tensors
    are drawn on the GPU when there is one."""
    import hashlib

    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = Path(folder)
    config = AutoConfig.from_pretrained(str(folder))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    dtype = torch.float32 if getattr(config, "torch_dtype", None) == torch.float32 \
        else torch.bfloat16
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        shapes.pop("lm_head.weight", None)  # the loader ties it to the embedding
    shard: Dict[str, Any] = {}
    size, index, files = 0, {}, []

    def flush() -> None:
        nonlocal shard, size
        if shard:
            name = f"model-{len(files) + 1:05d}.safetensors"
            save_file(shard, str(folder / name), metadata={"format": "pt"})
            files.append(name)
            index.update({k: name for k in shard})
        shard, size = {}, 0

    for name, shape in shapes.items():
        digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
        gen = torch.Generator(device=device).manual_seed(int.from_bytes(digest[:7], "little"))
        if name.endswith("norm.weight") or "layernorm" in name or "_norm." in name:
            t = torch.ones(shape, dtype=dtype)
        elif name.endswith(".bias"):
            t = torch.zeros(shape, dtype=dtype)
        else:
            t = (torch.randn(shape, generator=gen, device=device) * std).to(dtype).cpu()
        shard[name] = t.contiguous()
        size += t.numel() * t.element_size()
        if size >= shard_bytes:
            flush()
    flush()
    total = sum((folder / f).stat().st_size for f in files)
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": index}, indent=1))
    return folder


# ---------------------------------------------------------------- arithmetic
def _is_embedding(name: str) -> bool:
    return "embed_tokens" in name or name.endswith("wte.weight") or "embeddings" in name


def model_costs(model: Any, cfg: Dict[str, Any]) -> Dict[str, int]:
    """Parameter counts and bytes of a built model (any device, ``meta`` included).

    Returns params, param_bytes, weight_bytes_per_step (what one decode step reads),
    matmul_params (2-D weights less embedding and LM head), lm_head_params."""
    tied = bool(cfg.get("tie_word_embeddings", False))
    out = {"params": 0, "param_bytes": 0, "weight_bytes_per_step": 0, "matmul_params": 0,
           "lm_head_params": int(cfg["vocab_size"]) * int(cfg["hidden_size"])}
    for name, p in model.named_parameters():  # shared (tied) parameters appear once
        n, nbytes = p.numel(), p.numel() * p.element_size()
        out["params"] += n
        out["param_bytes"] += nbytes
        embed = _is_embedding(name)
        if not embed or tied:
            out["weight_bytes_per_step"] += nbytes
        if p.dim() >= 2 and not embed and "lm_head" not in name.split("."):
            out["matmul_params"] += n
    _add_quantized(model, out)
    return out


def _add_quantized(model: Any, out: Dict[str, int]) -> None:
    """Weights held by quantization methods (``--isq``, GGUF): their device bytes, and
    their logical sizes as parameters (a tied embedding's method counts once, as the
    head a step reads)."""
    seen = set()
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if method is None or id(method) in seen:
            continue
        seen.add(id(method))
        nbytes = method.weight_nbytes()
        if not nbytes:
            continue
        out["param_bytes"] += nbytes
        embed = _is_embedding(name)
        if not embed or getattr(model, "tie_word_embeddings", False):
            out["weight_bytes_per_step"] += nbytes
        size = getattr(module, "input_size", 0) * getattr(module, "output_size", 0)
        if size and "lm_head" not in name.split("."):
            out["matmul_params"] += size
            out["params"] += size


def kv_bytes_per_token_from_config(cfg: Dict[str, Any], dtype_bytes: int) -> int:
    """K and V of every layer for one token (full attention, no quantization)."""
    heads = int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    return 2 * int(cfg["num_hidden_layers"]) * kv_heads * head_dim * dtype_bytes


def prefill_flops(costs: Dict[str, int], cfg: Dict[str, Any], num_seqs: int, seq_len: int) -> float:
    """FLOPs of prefilling ``num_seqs`` prompts of ``seq_len`` tokens (see module doc)."""
    heads = int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    layers = int(cfg["num_hidden_layers"])
    tokens = num_seqs * seq_len
    linear = 2.0 * costs["matmul_params"] * tokens + 2.0 * costs["lm_head_params"] * num_seqs
    attention = 2.0 * layers * heads * head_dim * seq_len * (seq_len + 1) * num_seqs
    return linear + attention


def decode_roofline(weight_bytes: int, kv_bytes_per_token: int, steps: int, kv_tokens_read: int,
                    seconds: float, bandwidth_bps: float) -> Dict[str, float]:
    """Fraction of the copy bandwidth a decode window used: (weights x steps + KV read) / s."""
    bytes_read = float(weight_bytes) * steps + float(kv_bytes_per_token) * kv_tokens_read
    achieved = bytes_read / seconds if seconds > 0 else 0.0
    return {
        "bytes_per_step": bytes_read / steps if steps else 0.0,
        "achieved_bytes_per_s": achieved,
        "fraction_of_roofline": achieved / bandwidth_bps if bandwidth_bps > 0 else 0.0,
        "weights_only_fraction": (float(weight_bytes) * steps / seconds / bandwidth_bps
                                  if seconds > 0 and bandwidth_bps > 0 else 0.0),
    }


if __name__ == "__main__":  # python tools/bench_model.py DIR [--tiny]: a folder to serve
    import sys

    if len(sys.argv) < 2 or sys.argv[1].startswith("-"):
        sys.exit("usage: python tools/bench_model.py DIR [--tiny]   "
                 "(then: cvllm serve --w DIR --load-format dummy)")
    print(write_model_folder(Path(sys.argv[1]), build_config(tiny="--tiny" in sys.argv[2:])))

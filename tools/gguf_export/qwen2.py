"""qwen2: llama.cpp runs Qwen2 with NEOX (rotate-half) rope, so its converter writes Q/K
rows in HF order, unpermuted; q/k/v biases go to ``attn_{q,k,v}.bias``. llama.cpp has no
sliding window for qwen2, so the file carries none."""

from pathlib import Path
from typing import Optional

from .common import QuantPlan, base_kv, gguf_tensor_name, state_tensors, write_gguf


def qwen_kv(arch: str, cfg) -> dict:
    """Keys llama.cpp's converter writes for qwen2 / qwen3 (key_length / value_length only
    when the HF config names a head_dim, as its base converter does)."""
    kv = base_kv(arch, cfg)
    kv[f"{arch}.attention.layer_norm_rms_epsilon"] = float(cfg.rms_norm_eps)
    # The real converter derives the vocabulary from the tokenizer it embeds; these test
    # files take the tokenizer from the folder, so the size is written out.
    kv[f"{arch}.vocab_size"] = int(cfg.vocab_size)
    head_dim = getattr(cfg, "head_dim", None)
    if head_dim:
        kv[f"{arch}.attention.key_length"] = int(head_dim)
        kv[f"{arch}.attention.value_length"] = int(head_dim)
    return kv


def export(model, path: Path, plan: Optional[QuantPlan] = None) -> Path:
    return write_gguf(path, "qwen2", qwen_kv("qwen2", model.config),
                      state_tensors(model, gguf_tensor_name), plan)

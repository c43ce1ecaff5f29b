"""gemma3: as gemma2 (norms +1, tied lm_head skipped, the four norm names), plus q/k norms
(also +1); the global layers' rope base as rope.freq_base and their linear rope scaling
as rope.scaling.*; no softcaps. Not written, implied by llama.cpp: the local rope
base 10000, every 6th layer global, the attention scale (see gemma2.py)."""

from pathlib import Path
from typing import Optional

from .common import QuantPlan, state_tensors, write_gguf
from .gemma2 import gemma_kv, gemma_name, gemma_norm_plus_one


def export(model, path: Path, plan: Optional[QuantPlan] = None) -> Path:
    cfg = model.config.get_text_config()
    if cfg.attn_logit_softcapping is not None or cfg.final_logit_softcapping is not None:
        raise ValueError("llama.cpp's gemma3 has no softcaps")
    kv = gemma_kv("gemma3", cfg)
    full = cfg.rope_parameters["full_attention"]
    kv["gemma3.rope.freq_base"] = float(full["rope_theta"])
    if full.get("rope_type", "default") != "default":
        if full["rope_type"] != "linear":
            raise ValueError(f"llama.cpp's gemma3 converter takes linear rope scaling only, "
                             f"not {full['rope_type']!r}")
        kv["gemma3.rope.scaling.type"] = "linear"
        kv["gemma3.rope.scaling.factor"] = float(full["factor"])
    tensors = state_tensors(model, gemma_name, gemma_norm_plus_one)
    return write_gguf(path, "gemma3", kv, tensors, plan)

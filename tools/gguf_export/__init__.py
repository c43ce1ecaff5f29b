"""Writers of GGUF files that follow llama.cpp's converter conventions (tensor names,
metadata keys, tensor rewrites such as the llama Q/K permutation), one module per
llama.cpp architecture, built on ``common``.

Used by ``tools/write_gguf.py`` and by the tests (tiny GGUF files of tiny transformers
models); cvllm never imports ``tools/``. ``exporter_for`` picks the module for a
transformers config.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Dict

EXPORTERS: Dict[str, str] = {
    "llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
    "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "phi": "phi2", "phi3": "phi3",
    "stablelm": "stablelm", "gemma2": "gemma2", "gemma3": "gemma3", "gemma3_text": "gemma3",
    "glm4": "glm4", "deepseek_v2": "deepseek2", "deepseek_v3": "deepseek2",
}
"""transformers ``model_type`` -> module of this package (llama.cpp converts Mistral as
``llama``, DeepSeek V2 and V3 as ``deepseek2``)."""


def exporter_for(config: Any) -> Callable[..., Any]:
    """The ``export(model, path, plan=None)`` function for a transformers config."""
    model_type = getattr(config, "model_type", None)
    if model_type not in EXPORTERS:
        raise ValueError(f"no GGUF exporter for model_type {model_type!r}; known: "
                         f"{', '.join(sorted(EXPORTERS))}")
    return importlib.import_module(f".{EXPORTERS[model_type]}", __name__).export

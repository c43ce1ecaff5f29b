"""HF architecture name -> model class, imported lazily by module name.

Read by the worker (and the loader, to reject an unsupported checkpoint early) with the
``architectures[0]`` of config.json or the GGUF's ``general.architecture`` mapped to it.
"""

from __future__ import annotations

import importlib
from typing import Dict, List, Tuple

# architecture -> (module under cvllm.models, class name)
_MODELS: Dict[str, Tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "MistralForCausalLM"),
    "DeepseekV2ForCausalLM": ("deepseek_v2", "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": ("deepseek_v2", "DeepseekV3ForCausalLM"),
    "PhiForCausalLM": ("phi", "PhiForCausalLM"),
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
    "StableLmForCausalLM": ("stablelm", "StableLmForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "Qwen2MoeForCausalLM": ("qwen2_moe", "Qwen2MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "Qwen3NextForCausalLM": ("qwen3_next", "Qwen3NextForCausalLM"),
    "Qwen3_5ForCausalLM": ("qwen3_5", "Qwen3_5ForCausalLM"),
    "Qwen3_5MoeForCausalLM": ("qwen3_5", "Qwen3_5MoeForCausalLM"),
    "Glm4ForCausalLM": ("glm4", "Glm4ForCausalLM"),
    "Gemma2ForCausalLM": ("gemma2", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma3", "Gemma3ForCausalLM"),
    "Gemma3ForConditionalGeneration": ("gemma3", "Gemma3ForConditionalGeneration"),
}


class UnsupportedArchitectureError(ValueError):
    """The checkpoint's architecture has no model class here; the message lists those that do."""


def supported_architectures() -> List[str]:
    return sorted(_MODELS)


def get_model_class(architecture: str) -> type:
    if architecture not in _MODELS:
        supported = ", ".join(supported_architectures())
        raise UnsupportedArchitectureError(
            f"unsupported model architecture {architecture!r}; supported: {supported}"
        )
    module_name, class_name = _MODELS[architecture]
    module = importlib.import_module(f"cvllm.models.{module_name}")
    return getattr(module, class_name)

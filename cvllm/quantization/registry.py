"""Which ``QuantizationConfig`` reads a checkpoint's own ``quantization_config``.

A Hugging Face folder quantized by its author says so in its config.json:
``"quantization_config": {"quant_method": "gptq", "bits": 4, ...}``. The loader
(``loader/quant_scheme.py``) looks the ``quant_method`` up here while it builds the engine
config, on every rank from the same file; a method without an entry is refused at
start-up. This table is the one place such a config is chosen: a new format adds its
``QuantizationConfig`` subclass (and methods) in ``quantization/<format>.py`` and one
entry below, and no other module changes. None is read yet (GPTQ, AWQ,
compressed-tensors, FP8, MXFP4 and NVFP4 come next); GGUF files and ``--isq`` carry no
``quantization_config`` and get ``gguf.GGUFQuantConfig`` from the loader directly.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional

from cvllm.quantization.base import QuantizationConfig

CheckpointConfigFactory = Callable[[Dict[str, Any]], QuantizationConfig]
"""Builds the config from the checkpoint's ``quantization_config`` object (a dict)."""

CHECKPOINT_FORMATS: Dict[str, CheckpointConfigFactory] = {}
"""``quant_method`` (lower case, as config.json spells it) -> its config's factory."""


def quant_method(checkpoint_config: Any) -> str:
    """The ``quant_method`` a ``quantization_config`` names, lower case; ``""`` when it
    names none (or is not an object)."""
    if not isinstance(checkpoint_config, dict):
        return ""
    method = checkpoint_config.get("quant_method")
    return method.strip().lower() if isinstance(method, str) else ""


def checkpoint_format(checkpoint_config: Any) -> Optional[CheckpointConfigFactory]:
    """The factory of the format a ``quantization_config`` names, or None when cvllm has
    none for it."""
    return CHECKPOINT_FORMATS.get(quant_method(checkpoint_config))

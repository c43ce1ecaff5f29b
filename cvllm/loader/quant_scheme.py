"""The model's quantization scheme: which ``QuantizationConfig`` its constructor gets.

Called by ``engine/builder.build_engine_config`` on every rank, from the same flags and
files, so every rank holds an equal config (``EngineConfig.quant``); the model
constructor hands it to each parallel layer, which asks it for its method. The scheme
comes from, first that applies:

- a checkpoint's own ``quantization_config`` (config.json): the config of its
  ``quant_method`` from ``quantization/registry.py``, refused when cvllm has none;
- ``--isq`` on a Hugging Face folder: its float weights quantized while loading;
- a GGUF file's tensor types (unless ``--dequantize``): each layer in its file's type;
  types without kernels are dequantized at load, with one warning per type;
- else None: float weights.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, Optional

from cvllm.config import ConfigError, ModelConfig, check_cpu_dense_gib
from cvllm.kernels.quant.ggml_types import FLOAT_TYPES, QUANTIZED_TYPES, GgmlType, parse_isq
from cvllm.models.registry import get_model_class
from cvllm.quantization import registry
from cvllm.quantization.base import QuantizationConfig
from cvllm.quantization.gguf import GGUFQuantConfig

from .errors import ModelLoadError
from .gguf_loader import gguf_tensor_types
from .source import ModelSource

logger = logging.getLogger("cvllm.loader")


def quantization_config(source: ModelSource, model_config: ModelConfig,
                        isq: Optional[str] = None, dequantize: bool = False,
                        cpu_dense_gib: Optional[float] = None) -> Optional[QuantizationConfig]:
    """The config the loader chose for this model (module docstring), or None for float
    weights. ``cpu_dense_gib``: ``--cpu-dense-gb``, checked whatever the weights are."""
    check_cpu_dense_gib(cpu_dense_gib)
    checkpoint = model_config.get("quantization_config")
    if checkpoint is not None:
        return checkpoint_config(source, checkpoint)
    mapping = get_model_class(model_config.architecture).stacked_params_mapping
    if isq is not None:
        return GGUFQuantConfig(isq=isq_name(source, isq), stacked_params_mapping=mapping,
                               cpu_dense_gib=cpu_dense_gib)
    if source.kind != "gguf" or dequantize:
        return None
    types = gguf_tensor_types(source.path)
    warn_dequantized_types(types)
    return GGUFQuantConfig(tensor_types=types, stacked_params_mapping=mapping,
                           cpu_dense_gib=cpu_dense_gib)


def checkpoint_config(source: ModelSource, checkpoint: Any) -> QuantizationConfig:
    """The config of a checkpoint quantized by its author, from its ``quant_method``;
    a method cvllm cannot read is refused before any weight loads."""
    factory = registry.checkpoint_format(checkpoint)
    if factory is None:
        method = registry.quant_method(checkpoint) or "an unnamed method"
        known = ", ".join(sorted(registry.CHECKPOINT_FORMATS)) or "none yet"
        raise ModelLoadError(
            f"{source.path}: config.json has a quantization_config ({method}): the "
            f"checkpoint was quantized by its author, in a format cvllm cannot read "
            f"(it reads: {known}). Serve the float checkpoint (--isq quantizes it while "
            f"loading) or a GGUF file instead.")
    return factory(checkpoint)


def isq_name(source: ModelSource, isq: str) -> str:
    """``--isq``, checked: a type name cvllm quantizes to, on a Hugging Face folder."""
    if source.kind == "gguf":
        raise ConfigError(f"--isq quantizes the float weights of a Hugging Face folder; "
                          f"{source.path} is a GGUF file, already quantized (drop --isq)")
    try:
        parse_isq(isq)
    except ValueError as e:
        raise ConfigError(f"--isq: {e}") from None
    return isq


def warn_dequantized_types(types: Dict[str, int]) -> None:
    """One warning per GGML type that has no kernels: its tensors are dequantized at load."""
    slow: Dict[str, int] = {}
    for t in types.values():
        if t not in QUANTIZED_TYPES and t not in FLOAT_TYPES:
            try:
                name = GgmlType(t).name
            except ValueError:
                name = f"id {t}"
            slow[name] = slow.get(name, 0) + 1
    for name, n in sorted(slow.items()):
        logger.warning("%d tensor(s) of type %s: cvllm has no kernels for it, so they are "
                       "dequantized to the model dtype at load", n, name)

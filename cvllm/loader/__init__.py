"""Model loading: where the model is, its config, its weights and its tokenizer.

Called by the composition root (``cli.py``) and the worker on every rank; each rank reads
its own copy of the files (memory-mapped, so ranks on one host share the page cache).

    source = resolve_model_source(weight_path, weight_file, model_id)
    model_config = load_model_config(source, dtype, max_model_len)
    quant = quantization_config(source, model_config, isq, dequantize, cpu_dense_gib)
                                                 # QuantizationConfig, or None: float
    model.load_weights(iter_weights(source))     # HF names, lazy tensors (each rank
                                                 # reads only its shards)
    tokenizer = load_tokenizer(source)           # transformers fast tokenizer
    defaults = generation_defaults(source)       # temperature/top_p/top_k... of the author

Everything that can go wrong with the files raises ``ModelLoadError``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Iterator, Optional, Tuple

from ..config import ConfigError, ModelConfig
from .default_model import default_model_path
from .errors import ModelLoadError
from .hf_config import (merge_ids, read_generation_config, read_hf_config, sampling_defaults,
                        token_ids)
from .source import ModelSource, resolve_model_source

if TYPE_CHECKING:  # torch is imported only when weights are read or quantized
    from ..quantization.base import QuantizationConfig
    from .lazy import LazyTensor

__all__ = [
    "ModelLoadError", "ModelSource", "resolve_model_source", "default_model_path",
    "load_model_config", "quantization_config", "iter_weights", "gguf_tensor_types",
    "load_tokenizer", "generation_defaults",
]


def load_model_config(source: ModelSource, dtype: str = "f32",
                      max_model_len: int = 0) -> ModelConfig:
    """ModelConfig from config.json (+ generation_config.json) or GGUF metadata."""
    if source.kind == "hf":
        hf = read_hf_config(source.path)
        gen = read_generation_config(source.path)
        eos = merge_ids(token_ids(gen.get("eos_token_id")), token_ids(hf.get("eos_token_id")))
    else:
        from .gguf_config import gguf_eos_token_ids, gguf_to_hf_config
        from .gguf_loader import open_gguf

        reader = open_gguf(source.path)
        hf = gguf_to_hf_config(reader)
        gen = read_generation_config(source.tokenizer_path)
        eos = merge_ids(token_ids(gen.get("eos_token_id")), gguf_eos_token_ids(reader))
    bos = token_ids(gen.get("bos_token_id")) or token_ids(hf.get("bos_token_id"))
    try:
        return ModelConfig(architecture=hf["architectures"][0], hf_config=hf, dtype=dtype,
                           max_model_len=max_model_len, eos_token_ids=eos,
                           bos_token_id=bos[0] if bos else None, source=str(source.path))
    except ConfigError as e:
        raise ModelLoadError(f"{source.path}: {e}") from e


def quantization_config(source: ModelSource, model_config: ModelConfig,
                        isq: Optional[str] = None, dequantize: bool = False,
                        cpu_dense_gib: Optional[float] = None) -> Optional["QuantizationConfig"]:
    """The model's quantization scheme (``quant_scheme.py``): from a checkpoint's
    ``quantization_config``, ``--isq`` or a GGUF file's tensor types; None: float."""
    from .quant_scheme import quantization_config as _choose

    return _choose(source, model_config, isq, dequantize, cpu_dense_gib)


def iter_weights(source: ModelSource) -> Iterator[Tuple[str, "LazyTensor"]]:
    """Yield ``(hf_name, LazyTensor)`` for every weight (``lazy.py``): nothing is read
    until a weight loader materialises it, after narrowing it to this rank's shard. GGUF
    tensors read as float32 with Q/K rows in HF order, safetensors in the file's dtype."""
    if source.kind == "hf":
        from .safetensors_loader import iter_safetensors_weights

        return iter_safetensors_weights(source.path)
    from .gguf_loader import iter_gguf_weights

    return iter_gguf_weights(source.path)


def gguf_tensor_types(path) -> Dict[str, int]:
    """``HF name -> GGML type id`` of a GGUF file's weights."""
    from .gguf_loader import gguf_tensor_types as _types

    return _types(path)


def load_tokenizer(source: ModelSource) -> Any:
    """A ``transformers`` fast tokenizer with ``chat_template`` (when the model has one)."""
    from .tokenizer import load_tokenizer as _load

    return _load(source)


def generation_defaults(source: ModelSource) -> Dict[str, Any]:
    """The model author's sampling defaults (temperature, top_p, top_k, min_p,
    repetition_penalty) from generation_config.json; only the keys it sets."""
    folder = source.path if source.kind == "hf" else source.tokenizer_path
    return sampling_defaults(read_generation_config(folder))

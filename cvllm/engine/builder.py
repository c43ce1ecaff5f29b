"""From user-facing options to a running ``LLMEngine`` (rank 0, single process).

Called by ``cli.py`` and by the offline ``LLM`` class. It resolves where the model comes
from, builds the config dataclasses, loads the tokenizer and the model (through the
``ModelRunner``), sizes the KV cache and hands everything to ``LLMEngine``.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Dict, List, Optional, Tuple

from cvllm.config import (
    ATTENTION_BACKENDS,
    CacheConfig,
    ConfigError,
    DeviceConfig,
    EngineConfig,
    SchedulerConfig,
)
from cvllm.engine.llm_engine import LLMEngine
from cvllm.engine.tokenizer import Tokenizer
from cvllm.models.registry import get_model_class
from cvllm.sampling_params import DEFAULTABLE_SAMPLING_KEYS

logger = logging.getLogger("cvllm.engine")



def _pick_device(cpu: bool, device_ids: List[int]) -> DeviceConfig:
    import torch

    if cpu:
        return DeviceConfig("cpu", device_ids)
    if not torch.cuda.is_available():
        logger.warning("no CUDA device found: running on the CPU (pass --cpu to silence this)")
        return DeviceConfig("cpu", device_ids)
    if len(device_ids) > 1:
        raise ConfigError("several --device-ids need tensor parallelism, which this build does "
                          "not have yet; give one device id")
    if device_ids[0] >= torch.cuda.device_count():
        raise ConfigError(f"--device-ids {device_ids[0]}: only {torch.cuda.device_count()} CUDA devices")
    return DeviceConfig("cuda", device_ids)


def _sampling_defaults(overrides: Dict[str, Any], generation_defaults: Dict[str, Any]) -> Dict[str, Any]:
    """CLI flags over the model's generation_config.json over SamplingParams' own."""
    from cvllm.sampling_params import SamplingParams, SamplingParamsError

    out = {k: v for k, v in generation_defaults.items() if k in DEFAULTABLE_SAMPLING_KEYS and v is not None}
    out.update({k: v for k, v in (overrides or {}).items() if k in DEFAULTABLE_SAMPLING_KEYS and v is not None})
    try:
        SamplingParams(**out)
    except SamplingParamsError as e:
        raise ConfigError(f"--{e.param.replace('_', '-')}: {e}") from e
    return out


def build_llm_engine(
    weight_path: Optional[str] = None, weight_file: Optional[str] = None, model_id: Optional[str] = None,
    dtype: Optional[str] = None, cpu: bool = False, device_ids: Optional[List[int]] = None,
    kvcache_mem_mb: Optional[int] = None, gpu_memory_fraction: float = 0.7, max_num_seqs: int = 256,
    block_size: int = 16, max_model_len: int = 0, prefill_chunk_size: int = 8192,
    max_gen_tokens: int = 0, seed: int = 0, load_format: str = "auto",
    served_model_name: Optional[str] = None, sampling_overrides: Optional[Dict[str, Any]] = None,
    num_blocks: Optional[int] = None, yarn_scaling_factor: Optional[float] = None,
    disable_cuda_graph: bool = False, attention_backend: str = "auto", fp8_kvcache: bool = False,
) -> Tuple[LLMEngine, Dict[str, Any]]:
    """Returns the engine and the server-wide sampling defaults. ``disable_cuda_graph``
    and ``attention_backend`` only matter on CUDA (see ``EngineConfig``)."""
    from cvllm import loader
    from cvllm.worker.model_runner import ModelRunner

    # Check every flag before the (slow) model load, so a typo fails in a second.
    cache = CacheConfig(block_size=block_size, kvcache_mem_mb=kvcache_mem_mb,
                        gpu_memory_fraction=gpu_memory_fraction, num_blocks=num_blocks,
                        fp8_kvcache=fp8_kvcache)
    SchedulerConfig(max_num_seqs=max_num_seqs, max_model_len=max(max_model_len, 1),
                    prefill_chunk_size=prefill_chunk_size)
    if max_model_len < 0:
        raise ConfigError(f"--max-model-len must be >= 0 (0: the model's own), got {max_model_len}")
    if max_gen_tokens < 0:
        raise ConfigError(f"--max-gen-tokens must be >= 0 (0: derived), got {max_gen_tokens}")
    if yarn_scaling_factor is not None and not (math.isfinite(yarn_scaling_factor)
                                                and yarn_scaling_factor >= 1.0):
        raise ConfigError(f"--yarn-scaling-factor must be a number >= 1, got {yarn_scaling_factor}")
    _sampling_defaults(sampling_overrides or {}, {})
    if attention_backend not in ATTENTION_BACKENDS:
        raise ConfigError(f"--attention-backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                          f"got {attention_backend!r}")
    device = _pick_device(cpu, device_ids or [0])
    dtype = dtype or ("bf16" if device.device == "cuda" else "f32")
    source = loader.resolve_model_source(weight_path, weight_file, model_id)
    model_config = loader.load_model_config(source, dtype=dtype, max_model_len=max_model_len)
    get_model_class(model_config.architecture)  # unsupported: fail now, listing the supported
    context_len = model_config.native_max_len
    if yarn_scaling_factor is not None:
        context_len = apply_yarn_scaling(model_config.hf_config, yarn_scaling_factor)
        if not max_model_len:
            model_config.max_model_len = context_len
    if max_model_len and max_model_len > context_len:
        logger.warning("--max-model-len %d exceeds the model's own %d", max_model_len, context_len)
    defaults = _sampling_defaults(sampling_overrides or {}, loader.generation_defaults(source))
    config = EngineConfig(
        model=model_config,
        cache=cache,
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_model_len=model_config.max_model_len,
                                  prefill_chunk_size=prefill_chunk_size),
        device=device, load_format=load_format, seed=seed, max_gen_tokens=max_gen_tokens,
        served_model_name=served_model_name or _default_name(source),
        defaults=defaults, disable_cuda_graph=bool(disable_cuda_graph),
        attention_backend=attention_backend,
    )
    tokenizer = Tokenizer(loader.load_tokenizer(source))
    _check_eos(config, tokenizer)
    runner = ModelRunner(config, source)
    logger.info("model %s (%s) on %s, dtype %s, max_model_len %d, %d KV blocks of %d tokens",
                config.served_model_name, model_config.architecture, device.device, dtype,
                model_config.max_model_len, runner.num_blocks, block_size)
    defaults = dict(defaults, max_gen_tokens=config.max_gen_tokens)
    return LLMEngine(config, tokenizer, runner), defaults


def apply_yarn_scaling(hf_config: Dict[str, Any], factor: float) -> int:
    """Replace the model's rope scaling with YaRN at ``factor`` (in place), keeping its
    rope_theta and partial_rotary_factor; ``original_max_position_embeddings`` is the
    config's ``max_position_embeddings``. Written to ``rope_parameters`` and
    ``rope_scaling``, the two spellings ``rope_parameters_from_config`` merges, so every
    family reads it. Per-layer-type rope parameters (Gemma 3) are scaled except for the
    sliding layers, which never see a distance beyond their window. Returns the extended
    context length, ``factor x max_position_embeddings``."""
    original = int(hf_config.get("max_position_embeddings") or 2048)
    yarn = {"rope_type": "yarn", "factor": float(factor),
            "original_max_position_embeddings": original}

    def scaled(params: Dict[str, Any]) -> Dict[str, Any]:
        keep = {k: params[k] for k in ("rope_theta", "partial_rotary_factor") if k in params}
        return {**keep, **yarn}

    params = hf_config.get("rope_parameters")
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        hf_config["rope_parameters"] = {
            kind: (p if kind == "sliding_attention" else scaled(p)) for kind, p in params.items()
        }
    else:
        flat = dict(params or {})
        if "rope_theta" not in flat and hf_config.get("rope_theta") is not None:
            flat["rope_theta"] = hf_config["rope_theta"]
        hf_config["rope_parameters"] = scaled(flat)
        hf_config["rope_scaling"] = {k: v for k, v in hf_config["rope_parameters"].items()
                                     if k != "rope_theta"}
    return int(factor * original)


def _default_name(source) -> str:
    path = source.path
    return path.stem if path.suffix == ".gguf" else path.name


def _check_eos(config: EngineConfig, tokenizer: Tokenizer) -> None:
    if not config.model.eos_token_ids and tokenizer.eos_token_id is not None:
        config.model.eos_token_ids = [int(tokenizer.eos_token_id)]
    if not config.model.eos_token_ids:
        logger.warning("the model declares no EOS token: generation stops only at max_tokens")
    if config.model.bos_token_id is None and tokenizer.bos_token_id is not None:
        config.model.bos_token_id = int(tokenizer.bos_token_id)

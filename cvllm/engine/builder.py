"""From user-facing options to a running ``LLMEngine`` (rank 0) or a rank's runner.

Called by ``cli.py`` / ``runtime/spmd.py`` and by the offline ``LLM`` class. It resolves
where the model comes from, builds the config dataclasses (``build_engine_config``: the
same on every rank, checked before any weight loads, including that the tensor-parallel
size splits the attention heads; the loader reads the model's config and chooses its
quantization scheme), loads the tokenizer and the model (through the
``ModelRunner``), sizes the KV cache and hands everything to ``LLMEngine`` on rank 0.
Ranks != 0 build only the config and their ``ModelRunner`` (``worker/worker_loop.py``).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

from cvllm.config import (
    ATTENTION_BACKENDS,
    CacheConfig,
    ConfigError,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    default_max_num_batched_tokens,
)
from cvllm.engine.llm_engine import LLMEngine
from cvllm.engine.tokenizer import Tokenizer
from cvllm.models.registry import UnsupportedArchitectureError, get_model_class
from cvllm.sampling_params import DEFAULTABLE_SAMPLING_KEYS

logger = logging.getLogger("cvllm.engine")



def pick_device(cpu: bool, device_ids: List[int]) -> DeviceConfig:
    """The device of this rank: ``device_ids[0]`` (under tensor parallelism the launcher
    passes each rank its own id, ``launch_env.local_device_id``); every rank of a CPU run
    runs on the host."""
    import torch

    if cpu:
        return DeviceConfig("cpu", device_ids)
    if not torch.cuda.is_available():
        logger.warning("no CUDA device found: running on the CPU (pass --cpu to silence this)")
        return DeviceConfig("cpu", device_ids)
    if device_ids[0] >= torch.cuda.device_count():
        raise ConfigError(f"--device-ids {device_ids[0]}: only {torch.cuda.device_count()} CUDA devices")
    return DeviceConfig("cuda", [device_ids[0]])


def _uneven_tp_heads(architecture: str) -> bool:
    """Whether the family's layers take a tp size that does not divide the heads."""
    try:
        return bool(getattr(get_model_class(architecture), "uneven_tp_heads", False))
    except UnsupportedArchitectureError:
        return False


def check_tensor_parallel(model_config, tp_size: int) -> None:
    """Refuse a tensor-parallel size the model's layers cannot split, before anything
    loads. Families whose class sets ``uneven_tp_heads`` (Llama, Gemma 2 and their kin)
    take any size up to the attention heads (a balanced uneven split of the query heads
    when it does not divide them); the others need one that divides the heads and that
    splits or replicates the KV heads by a whole factor."""
    if tp_size <= 1:
        return
    heads, kv_heads = model_config.num_heads, model_config.num_kv_heads
    if tp_size > heads:
        raise ConfigError(f"{model_config.architecture} has {heads} attention heads: "
                          f"{tp_size} ranks would leave some rank without one; use at most "
                          f"{heads} ranks")
    if _uneven_tp_heads(model_config.architecture):
        return
    if heads % tp_size:
        fits = [d for d in range(2, heads + 1) if heads % d == 0]
        raise ConfigError(
            f"{model_config.architecture} has {heads} attention heads, which {tp_size} ranks "
            f"cannot split evenly; use a number of ranks that divides {heads} "
            f"({', '.join(map(str, fits[:6]))})")
    if kv_heads % tp_size and tp_size % kv_heads:
        raise ConfigError(f"{model_config.architecture} has {kv_heads} KV heads: {tp_size} "
                          "ranks neither split nor replicate them evenly")


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


@dataclass
class EngineSetup:
    """What every rank builds identically from the options before loading weights."""

    config: EngineConfig
    source: Any
    """The resolved ``loader.ModelSource``."""
    defaults: Dict[str, Any]
    """Server-wide sampling defaults (CLI over generation_config.json)."""


def build_engine_config(
    weight_path: Optional[str] = None, weight_file: Optional[str] = None, model_id: Optional[str] = None,
    dtype: Optional[str] = None, cpu: bool = False, device_ids: Optional[List[int]] = None,
    kvcache_mem_mb: Optional[int] = None, gpu_memory_fraction: float = 0.7, max_num_seqs: int = 256,
    block_size: int = 16, max_model_len: int = 0, prefill_chunk_size: Optional[int] = None,
    max_num_batched_tokens: Optional[int] = None,
    max_gen_tokens: int = 0, seed: int = 0, load_format: str = "auto",
    served_model_name: Optional[str] = None, sampling_overrides: Optional[Dict[str, Any]] = None,
    num_blocks: Optional[int] = None, yarn_scaling_factor: Optional[float] = None,
    disable_cuda_graph: bool = False, attention_backend: str = "auto", fp8_kvcache: bool = False,
    disable_prefix_cache: bool = False, prefix_cache_max_tokens: Optional[int] = None,
    isq: Optional[str] = None, dequantize: bool = False, cpu_dense_gb: Optional[float] = None,
    cuda_graph_max_tokens: int = 512,
    *, tp_size: int = 1, device: Optional[DeviceConfig] = None,
) -> EngineSetup:
    """Check every option and read the model's config (no weights): the same on every
    rank. ``device`` is this rank's (``pick_device``); default: the single-process one."""
    from cvllm import loader

    # Check every flag before the (slow) model load, so a typo fails in a second.
    cache = CacheConfig(block_size=block_size, kvcache_mem_mb=kvcache_mem_mb,
                        gpu_memory_fraction=gpu_memory_fraction, num_blocks=num_blocks,
                        fp8_kvcache=fp8_kvcache, enable_prefix_caching=not disable_prefix_cache,
                        prefix_cache_max_tokens=prefix_cache_max_tokens)
    _check_flags(max_num_seqs, max_model_len, prefill_chunk_size, max_num_batched_tokens,
                 max_gen_tokens, cuda_graph_max_tokens, yarn_scaling_factor,
                 sampling_overrides, attention_backend)
    device = device or pick_device(cpu, device_ids or [0])
    dtype = dtype or ("bf16" if device.device == "cuda" else "f32")
    source = loader.resolve_model_source(weight_path, weight_file, model_id)
    model_config = _model_config(source, dtype, max_model_len, yarn_scaling_factor, tp_size)
    defaults = _sampling_defaults(sampling_overrides or {}, loader.generation_defaults(source))
    config = EngineConfig(
        model=model_config,
        cache=cache,
        scheduler=_scheduler_config(model_config, device, max_num_seqs, prefill_chunk_size,
                                    max_num_batched_tokens),
        device=device, load_format=load_format, seed=seed, max_gen_tokens=max_gen_tokens,
        served_model_name=served_model_name or _default_name(source),
        defaults=defaults, disable_cuda_graph=bool(disable_cuda_graph),
        cuda_graph_max_tokens=int(cuda_graph_max_tokens), attention_backend=attention_backend,
        quant=loader.quantization_config(source, model_config, isq, dequantize, cpu_dense_gb),
    )
    return EngineSetup(config, source, defaults)


def _check_flags(max_num_seqs: int, max_model_len: int, prefill_chunk_size: Optional[int],
                 max_num_batched_tokens: Optional[int], max_gen_tokens: int,
                 cuda_graph_max_tokens: int, yarn_scaling_factor: Optional[float],
                 sampling_overrides: Optional[Dict[str, Any]], attention_backend: str) -> None:
    """Refuse a bad scheduler, length, graph, YaRN, sampling or attention flag (ConfigError
    naming it) before anything is read from the model."""
    SchedulerConfig(max_num_seqs=max_num_seqs, max_model_len=max(max_model_len, 1),
                    prefill_chunk_size=prefill_chunk_size,
                    max_num_batched_tokens=max_num_batched_tokens or 0)
    if max_model_len < 0:
        raise ConfigError(f"--max-model-len must be >= 0 (0: the model's own), got {max_model_len}")
    if max_gen_tokens < 0:
        raise ConfigError(f"--max-gen-tokens must be >= 0 (0: derived), got {max_gen_tokens}")
    if cuda_graph_max_tokens < 0:
        raise ConfigError(f"--cuda-graph-max-tokens must be >= 0, got {cuda_graph_max_tokens}")
    if yarn_scaling_factor is not None and not (math.isfinite(yarn_scaling_factor)
                                                and yarn_scaling_factor >= 1.0):
        raise ConfigError(f"--yarn-scaling-factor must be a number >= 1, got {yarn_scaling_factor}")
    _sampling_defaults(sampling_overrides or {}, {})
    if attention_backend not in ATTENTION_BACKENDS:
        raise ConfigError(f"--attention-backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                          f"got {attention_backend!r}")


def _scheduler_config(model_config: ModelConfig, device: DeviceConfig, max_num_seqs: int,
                      prefill_chunk_size: Optional[int],
                      max_num_batched_tokens: Optional[int]) -> SchedulerConfig:
    """The scheduler's config for this model (its ``max_model_len``) on this device."""
    return SchedulerConfig(
        max_num_seqs=max_num_seqs, max_model_len=model_config.max_model_len,
        prefill_chunk_size=prefill_chunk_size,
        # CPU: attention over a long context is most of a chunk's time (no fast kernel)
        chunk_context_tokens=(attention_parity_context(model_config)
                              if device.device == "cpu" else 0),
        copy_prefix_hits=device.device == "cpu",
        max_num_batched_tokens=_step_budget(max_num_batched_tokens, prefill_chunk_size,
                                            device.device))


def _model_config(source, dtype: str, max_model_len: int, yarn_scaling_factor: Optional[float],
                  tp_size: int) -> ModelConfig:
    """The loader's ``ModelConfig``, checked against the model classes and ``tp_size``,
    with ``--yarn-scaling-factor`` applied."""
    from cvllm import loader

    model_config = loader.load_model_config(source, dtype=dtype, max_model_len=max_model_len)
    get_model_class(model_config.architecture)  # unsupported: fail now, listing the supported
    check_tensor_parallel(model_config, tp_size)
    context_len = model_config.native_max_len
    if yarn_scaling_factor is not None:
        context_len = apply_yarn_scaling(model_config.hf_config, yarn_scaling_factor)
        if not max_model_len:
            model_config.max_model_len = context_len
    if max_model_len and max_model_len > context_len:
        logger.warning("--max-model-len %d exceeds the model's own %d", max_model_len, context_len)
    return model_config


def attention_parity_context(mc: ModelConfig) -> int:
    """The context length at which a token's attention (2 H D multiply-adds a context token
    and layer: scores and values) costs what its matmuls cost (the projections and the MLP,
    routed experts' widths for MoE), from the config; 0 when the config lacks a size.
    SmolLM2-135M: 3,072 (measured on a 2-core Xeon without AMX: about 4,100); an 8B Llama:
    26,624."""
    try:
        hidden, hd = int(mc.get("hidden_size")), int(mc.head_dim)
        heads, kv_heads = int(mc.num_heads), int(mc.num_kv_heads)
        inter = int(mc.get("intermediate_size") or 4 * hidden)
        moe, top_k = mc.get("moe_intermediate_size"), mc.get("num_experts_per_tok")
        if moe and top_k:
            inter = int(moe) * int(top_k) + int(mc.get("shared_expert_intermediate_size") or 0)
    except (TypeError, ValueError, KeyError, AttributeError):
        return 0
    linear = hidden * (2 * heads * hd + 2 * kv_heads * hd) + 3 * hidden * inter
    return max(1, linear // (2 * heads * hd)) if heads and hd else 0


def _step_budget(flag: Optional[int], prefill_chunk_size: Optional[int], device: str) -> int:
    """--max-num-batched-tokens, else the device's default when --prefill-chunk-size does
    not derive it (0: ``SchedulerConfig`` derives it)."""
    if flag:
        return flag
    return default_max_num_batched_tokens(device) if prefill_chunk_size is None else 0


def build_llm_engine(*, rank: int = 0, tp_size: int = 1, device: Optional[DeviceConfig] = None,
                     wrap_runner: Optional[Callable[[Any], Any]] = None,
                     **options: Any) -> Tuple[LLMEngine, Dict[str, Any]]:
    """Returns rank 0's engine and the server-wide sampling defaults. ``options`` are
    ``build_engine_config``'s (the CLI flags by their long names); ``disable_cuda_graph``
    and ``attention_backend`` only matter on CUDA (see ``EngineConfig``). With tensor
    parallelism, ``wrap_runner`` wraps the ModelRunner so that each step reaches the
    other ranks first (``runtime/spmd.py``)."""
    from cvllm import loader
    from cvllm.worker.model_runner import ModelRunner

    setup = build_engine_config(**options, tp_size=tp_size, device=device)
    config, source = setup.config, setup.source
    tokenizer = Tokenizer(loader.load_tokenizer(source))
    _check_eos(config, tokenizer)
    runner = ModelRunner(config, source, rank)
    logger.info("model %s (%s) on %s, dtype %s, max_model_len %d, %d KV blocks of %d tokens%s",
                config.served_model_name, config.model.architecture, config.device.device,
                config.model.dtype, config.model.max_model_len, runner.num_blocks,
                config.cache.block_size, f", tensor parallel over {tp_size} ranks" if tp_size > 1 else "")
    if wrap_runner is not None:
        runner = wrap_runner(runner)
    defaults = dict(setup.defaults, max_gen_tokens=config.max_gen_tokens)
    sched = config.scheduler
    chunks = ("off" if sched.prefill_chunk_size == 0 else
              f"at most {min(sched.chunk_limit, sched.max_num_batched_tokens)} tokens a sequence")
    logger.info("step budget %d tokens (--max-num-batched-tokens); prompt chunks %s",
                sched.max_num_batched_tokens, chunks)
    # The overlapped loop only pays on CUDA, where launch() returns before the step ends.
    # On the CPU launch() runs the whole step, so overlapping would hold each step's
    # outputs back until the next step is computed: a first token one step later
    # (tools/bench_fairness.py, default model, a short request beside an 8k prompt:
    # TTFT 2.0 s overlapped, 1.4 s not; same prefill time).
    return LLMEngine(config, tokenizer, runner, overlap=config.device.device == "cuda"), defaults


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

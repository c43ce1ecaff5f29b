"""The ModelRunner's start-up: load the model, size its KV cache, build its graph runners.

Called once per rank by ``ModelRunner.__init__`` (``worker/model_runner.py``), in this
order: ``load_model``, ``model_cache_specs``, ``size_kv_cache`` (the runner then allocates
the cache), ``init_cuda_graphs`` and ``init_mixed_graphs``. Owns nothing: the runner
keeps what each returns; nothing here runs once the engine serves.
"""

from __future__ import annotations

import logging
import time
from typing import List, Optional

import torch

from cvllm.attention.kv_cache import CacheSizing, plan_kv_cache
from cvllm.attention.specs import FullAttentionSpec, LayerCacheSpec, SlidingWindowSpec
from cvllm.config import EngineConfig
from cvllm.core.kv_cache_manager import KVCacheLayout
from cvllm.distributed import parallel_state
from cvllm.models.registry import get_model_class
from cvllm.quantization.summary import format_summary, weight_summary
from cvllm.worker import memory
from cvllm.worker.cuda_graph import CudaGraphRunner, capture_sizes
from cvllm.worker.mixed_graph import MixedGraphRunner, split_unsafe_reason, token_sizes

logger = logging.getLogger("cvllm.worker")

# Without --mem the CPU cache takes this fraction of available memory, at most this many
# bytes: a CPU host runs other things, and a few GiB hold thousands of tokens already.
_CPU_KV_CAP_BYTES = 2 << 30


def load_model(config: EngineConfig, source, device: torch.device,
               dtype: torch.dtype) -> torch.nn.Module:
    """The model of ``config`` built on ``device`` in ``dtype``, its weights loaded from
    ``source`` (or dummy ones), in eval mode."""
    from cvllm import loader

    cls = get_model_class(config.model.architecture)
    quant_config = config.quant  # chosen by the loader (loader/quant_scheme.py)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):  # the layers' backend: config.model.attention_backend
            model = cls(config.model, quant_config)
    finally:
        torch.set_default_dtype(prev)
    if config.load_format == "dummy":
        model.init_dummy_weights(config.seed)
    else:
        model.load_weights(loader.iter_weights(source))
    per_type, total = weight_summary(model)
    logger.info(format_summary(per_type, total, device))
    if quant_config is not None and quant_config.loaded_note():
        logger.info(quant_config.loaded_note())
    return model.eval()


def model_cache_specs(model: torch.nn.Module, config: EngineConfig, dtype: torch.dtype
                      ) -> List[LayerCacheSpec]:
    """The model's ``cache_specs()``; without it, specs from its ``Attention`` modules when
    there is one per layer (so a sliding window is honoured), else full attention for
    every layer from the config."""
    num_layers = config.model.num_layers
    if hasattr(model, "cache_specs"):
        specs = list(model.cache_specs())
        if len(specs) != num_layers:
            raise ValueError(f"{type(model).__name__}.cache_specs() gave {len(specs)} specs "
                             f"for {num_layers} layers")
        return specs
    from cvllm.layers.attention import Attention

    attns = [m for m in model.modules() if isinstance(m, Attention)]
    if len(attns) == num_layers:
        return [
            SlidingWindowSpec(a.num_kv_heads, a.head_size, dtype, int(a.sliding_window))
            if a.sliding_window else FullAttentionSpec(a.num_kv_heads, a.head_size, dtype)
            for a in attns
        ]
    from cvllm.layers.linear import kv_head_assignment

    tp = parallel_state.get_tensor_model_parallel_world_size()
    kv_heads = len(kv_head_assignment(config.model.num_heads, config.model.num_kv_heads, tp, 0))
    return [FullAttentionSpec(kv_heads, config.model.head_dim, dtype)] * num_layers


def size_kv_cache(config: EngineConfig, model: torch.nn.Module,
                  cache_specs: List[LayerCacheSpec], device: torch.device,
                  capture: bool) -> KVCacheLayout:
    """Size every group (``attention/kv_cache.py`` documents the split) from --mem,
    --gpu-memory-fraction (on CUDA after profiling, ``worker/memory.py``; ``capture``:
    keep room for the CUDA graph pool) or the CPU default, or from a fixed
    CacheConfig.num_blocks."""
    cache, sched = config.cache, config.scheduler
    sizing = CacheSizing(
        block_size=cache.block_size, max_num_seqs=sched.max_num_seqs,
        max_model_len=config.model.max_model_len,
        max_num_batched_tokens=sched.max_num_batched_tokens,
        max_chunk=min(sched.chunk_limit, sched.max_num_batched_tokens),
    )
    if cache.num_blocks:
        return plan_kv_cache(cache_specs, sizing, num_blocks=cache.num_blocks)
    if cache.kvcache_mem_mb:
        budget = cache.kvcache_mem_mb * (1 << 20)
    elif device.type == "cuda":
        profile = memory.measure(
            model, cache_specs, block_size=cache.block_size,
            num_tokens=sched.max_step_tokens, max_seqs=sched.max_num_seqs,
            max_len=min(sizing.max_chunk, sizing.max_model_len),
            decode_rows=max([capture_sizes(sched.max_num_seqs)[-1],
                             *mixed_sizes(config)[-1:]]) if capture else 0,
            logit_rows=capture_sizes(sched.max_num_seqs)[-1] if capture else 0,
            device=device,
        )
        budget = memory.kv_cache_budget(profile, cache.gpu_memory_fraction,
                                        sched.max_step_tokens)
    else:
        import psutil

        avail = psutil.virtual_memory().available
        budget = min(int(avail * cache.gpu_memory_fraction), _CPU_KV_CAP_BYTES)
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        from cvllm.distributed import comm

        # Every rank must hold the same blocks (rank 0's scheduler hands out block ids
        # for all): all take the smallest budget. Cache specs match on every rank.
        budget = comm.agree_min(int(budget))
    return plan_kv_cache(cache_specs, sizing, budget_bytes=budget)


def init_cuda_graphs(config: EngineConfig, model: torch.nn.Module, kv_caches: list,
                     kv_layout: KVCacheLayout, device: torch.device,
                     unsafe: Optional[str]) -> Optional[CudaGraphRunner]:
    """Padded decode steps, captured now that the KV cache exists (CUDA only)."""
    if device.type != "cuda":
        return None
    if unsafe is not None:
        logger.info("decode steps run eagerly, unpadded: %s", unsafe)
        return None
    sched = config.scheduler
    graphs = CudaGraphRunner(
        model, kv_caches, sizes=capture_sizes(sched.max_num_seqs),
        max_model_len=config.model.max_model_len,
        block_size=config.cache.block_size, windows=kv_layout.windows,
        device=device, capture=not config.disable_cuda_graph,
        sampled_rows=sched.max_num_seqs,
    )
    start, reserved = time.perf_counter(), torch.cuda.memory_reserved(device)
    graphs.capture()
    if graphs.graphs:
        logger.info("CUDA graphs: %d decode sizes up to %d captured in %.1f s (%.0f MiB)",
                    len(graphs.graphs), graphs.sizes[-1], time.perf_counter() - start,
                    (torch.cuda.memory_reserved(device) - reserved) / 2**20)
    else:
        logger.info("CUDA graphs off: decode steps run padded to %s, eagerly", graphs.sizes)
    return graphs


def mixed_sizes(config: EngineConfig) -> List[int]:
    """The token counts steps with prompt tokens are padded to (``--cuda-graph-max-tokens``)."""
    return token_sizes(config.cuda_graph_max_tokens, config.scheduler.max_step_tokens)


def init_mixed_graphs(config: EngineConfig, model: torch.nn.Module, kv_caches: list,
                      kv_layout: KVCacheLayout, device: torch.device,
                      graphs: Optional[CudaGraphRunner]) -> Optional[MixedGraphRunner]:
    """Padded steps with prompt tokens, captured after the decode graphs (``graphs``) into
    their pool (CUDA, graph-safe models, ``--cuda-graph-max-tokens`` > 0)."""
    sizes = mixed_sizes(config)
    if graphs is None or not sizes:
        return None
    unsafe = split_unsafe_reason(model)
    if unsafe is not None:
        logger.info("steps with prompt tokens run eagerly, unpadded: %s", unsafe)
        return None
    mixed = MixedGraphRunner(
        model, kv_caches, sizes=sizes, block_size=config.cache.block_size,
        windows=kv_layout.windows, device=device,
        capture=not config.disable_cuda_graph and bool(graphs.graphs))
    start, reserved = time.perf_counter(), torch.cuda.memory_reserved(device)
    mixed.capture(graphs.pool)
    if mixed.graphs:
        logger.info("CUDA graphs: steps with prompt tokens at %d sizes up to %d tokens "
                    "captured in %.1f s (%d pieces each, %.0f MiB)", len(mixed.graphs),
                    mixed.sizes[-1], time.perf_counter() - start,
                    len(mixed.graphs[mixed.sizes[-1]]),
                    (torch.cuda.memory_reserved(device) - reserved) / 2**20)
    else:
        logger.info("steps with prompt tokens up to %d tokens run padded to %s, eagerly",
                    mixed.sizes[-1], mixed.sizes)
    return mixed

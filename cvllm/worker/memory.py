"""KV cache budget on CUDA: profile the largest step, give a fraction of what is left.

Called once by the ``ModelRunner`` (every rank) after the weights are loaded and before
the KV cache is allocated, when neither ``--mem`` nor a fixed block count sizes it.
``profile_step_memory`` runs dummy steps through the real model with a throw-away cache
just big enough for them and measures, with ``torch.cuda.max_memory_allocated``, what a
step allocates beyond the weights: the largest step (``max_num_batched_tokens`` tokens,
logits and sampling for ``max_num_seqs`` rows) and the largest padded decode step, which
the CUDA graph pool keeps for good once captured. ``kv_cache_budget`` then gives

    fraction x (total - non-torch - weights - peak activations - graph pool margin)

to the KV cache, where non-torch is the memory torch's allocator does not own (the CUDA
context, library workspaces, other processes). Nothing here keeps state.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch

from cvllm.attention.kv_cache import allocate_kv_caches, group_layers, kv_caches_nbytes
from cvllm.attention.metadata import AttentionMetadata
from cvllm.attention.specs import LayerCacheSpec, StateSpec
from cvllm.config import ConfigError
from cvllm.core.block_manager import cdiv
from cvllm.core.kv_cache_manager import KVCacheGroupConfig, KVCacheLayout

logger = logging.getLogger("cvllm.worker")

GRAPH_POOL_SLACK = 128 << 20
"""Added to the largest padded decode step's activations for the graph pool: per-graph
allocations that outlive the step (workspaces, kernel parameters)."""

_GIB = float(1 << 30)


@dataclass(frozen=True)
class MemoryProfile:
    """Bytes measured on the device before the KV cache exists."""

    total: int
    non_torch: int
    weights: int
    peak_activation: int
    graph_margin: int


def kv_cache_budget(p: MemoryProfile, fraction: float, num_tokens: int) -> int:
    """``fraction`` of the memory left once the weights, the largest step and the graph
    pool are accounted for. Raises ConfigError when nothing is left."""
    left = p.total - p.non_torch - p.weights - p.peak_activation - p.graph_margin
    if left <= 0:
        raise ConfigError(
            f"no GPU memory is left for the KV cache: of {p.total / _GIB:.2f} GiB, the weights "
            f"take {p.weights / _GIB:.2f} GiB, a step of {num_tokens} tokens "
            f"{p.peak_activation / _GIB:.2f} GiB, CUDA graphs {p.graph_margin / _GIB:.2f} GiB "
            f"and the CUDA context / other processes {p.non_torch / _GIB:.2f} GiB: lower "
            "--max-num-batched-tokens / --max-num-seqs, pass --disable-cuda-graph, or use a "
            "larger GPU"
        )
    return int(fraction * left)


def dummy_seq_lens(num_tokens: int, max_seqs: int, max_len: int) -> List[int]:
    """Lengths of the profile step's fresh sequences: ``num_tokens`` in all (fewer when
    ``max_seqs`` sequences of ``max_len`` cannot hold them), as few and as long as
    possible, the attention backends' worst case."""
    num_tokens = min(num_tokens, max_seqs * max_len)
    full, rest = divmod(num_tokens, max_len)
    return [max_len] * full + ([rest] if rest else [])


def dummy_step(lens: Sequence[int], block_size: int, num_groups: int,
               contexts: Optional[Sequence[int]] = None
               ) -> Tuple[np.ndarray, np.ndarray, dict, int]:
    """Host arrays of a step of sequences with ``lens`` new tokens each (after
    ``contexts`` tokens already in the cache: none by default, fresh sequences), laid out
    in blocks 0.. of every group: ``(input_ids [T], positions [T], AttentionMetadata.build
    keyword arguments without device, blocks per group)``."""
    B = len(lens)
    ctx = list(contexts) if contexts is not None else [0] * B
    per_seq = [cdiv(c + n, block_size) for c, n in zip(ctx, lens)]
    tables = np.zeros((B, max(per_seq)), dtype=np.int64)  # [B, M]
    slots, start = [], 0
    for b, (n, nb) in enumerate(zip(lens, per_seq)):
        tables[b, :nb] = np.arange(start, start + nb)
        slots.append(start * block_size + ctx[b] + np.arange(n))
        start += nb
    slot_mapping = np.concatenate(slots)  # [T]: consecutive within each sequence
    positions = np.concatenate([c + np.arange(n) for c, n in zip(ctx, lens)])  # [T]
    kwargs = dict(
        slot_mapping=slot_mapping, query_start_loc=np.concatenate([[0], np.cumsum(lens)]),
        seq_lens=np.asarray(ctx) + np.asarray(lens), block_tables=tables,
        state_slots=np.arange(B),
    )
    return np.zeros_like(positions), positions, kwargs, start


def _dummy_forward(model: torch.nn.Module, specs: Sequence[LayerCacheSpec], lens: Sequence[int],
                   block_size: int, device: torch.device,
                   contexts: Optional[Sequence[int]] = None) -> Tuple[torch.Tensor, list]:
    """A forward over sequences ``lens`` (after ``contexts``, default none) in a throw-away
    cache of just their blocks: ``(hidden [T, hidden], caches)``."""
    groups = group_layers(specs)
    ids, pos, kwargs, num_blocks = dummy_step(lens, block_size, len(groups), contexts)
    has_state = any(isinstance(s, StateSpec) for s in specs)
    layout = KVCacheLayout(block_size, tuple(KVCacheGroupConfig(w, num_blocks, tuple(layer_ids))
                                             for w, layer_ids in groups),
                           len(lens) if has_state else 0)
    caches = allocate_kv_caches(specs, layout, device)
    windows = [w for w, _ in groups]
    meta = AttentionMetadata.build(
        device=device, sliding_window=windows[0],
        extra_groups=[(w, kwargs["slot_mapping"], kwargs["block_tables"]) for w in windows[1:]],
        **kwargs)
    hidden = model(torch.from_numpy(ids).to(device), torch.from_numpy(pos).to(device), meta,
                   caches)  # [T, hidden]
    return hidden, caches


@torch.inference_mode()
def profile_step_memory(model: torch.nn.Module, specs: Sequence[LayerCacheSpec],
                        lens: Sequence[int], block_size: int, num_sample_rows: int,
                        device: torch.device) -> int:
    """Peak bytes one step of fresh sequences ``lens`` allocates beyond what was allocated
    before it (and beyond its throw-away cache), forward, logits of ``num_sample_rows``
    rows (0: none) and a sampler pass with every stage on included."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    hidden, caches = _dummy_forward(model, specs, lens, block_size, device)
    if num_sample_rows:
        rows = torch.arange(num_sample_rows, device=device) % hidden.shape[0]  # [S]
        _profile_sampler(model.compute_logits(hidden[rows]), device)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base - kv_caches_nbytes(caches)
    del caches, hidden
    torch.cuda.empty_cache()
    return max(int(peak), 0)


WARM_UP_PREFILLS = ((7,), (16,), (24,), (32,), (40,), (3, 5))
"""Prefill steps run once at start-up on CUDA: every tile size of the prefill attention
kernel (its query tile follows the longest query: 16, 32 or 64 rows) and both of the
ways Triton specializes an integer argument (a multiple of 16 or not). A serving engine
meets them all soon (a short prompt, a prefix-cache hit's short suffix), and each first
meeting compiled a kernel in the middle of serving: on an H100, steps stalled up to
1.2 s and first tokens waited 1.9 s in tools/bench_serving.py's multi-turn workload."""
WARM_UP_MIXED = (((1,), (0,)), ((1,), (200,)), ((1, 9), (200, 100)), ((1,), (1100,)))
"""Eager steps whose first sequences decode (``(new tokens, context)`` per sequence): the
decode kernel with one split (a short context) and with several (64 keys or more), a
decode beside a prefix-cache hit, and a lone decode over more than 1,024 keys (more than
16 splits: the merge kernel's wide tile). Eager steps launch without PDL, so their
kernels are other compiled variants than the decode graphs' (``kernels/pdl.py``), and
the first mixed step to meet one compiled it mid-serving. Contexts are cut to
``max_model_len``."""


@torch.inference_mode()
def warm_up_prefill(model: torch.nn.Module, specs: Sequence[LayerCacheSpec], block_size: int,
                    device: torch.device, steps: Sequence[Sequence[int]] = WARM_UP_PREFILLS,
                    max_model_len: Optional[int] = None,
                    mixed: Sequence[Tuple[Sequence[int], Sequence[int]]] = WARM_UP_MIXED
                    ) -> float:
    """Run ``steps`` (lengths of fresh sequences) and ``mixed`` (lengths after contexts,
    when ``max_model_len`` is given) through the model and the LM head; every rank does
    (collectives in lockstep). Returns the seconds it took."""
    start = time.perf_counter()
    runs = [(lens, None) for lens in steps]
    if max_model_len:
        runs += [(lens, [max(0, min(c, max_model_len - n)) for c, n in zip(ctx, lens)])
                 for lens, ctx in mixed]
    for lens, contexts in runs:
        hidden, caches = _dummy_forward(model, specs, lens, block_size, device, contexts)
        model.compute_logits(hidden[-1:])
        del hidden, caches
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return time.perf_counter() - start


def _profile_sampler(logits: torch.Tensor, device: torch.device) -> None:
    """A sampler pass over ``logits [S, V]`` with penalties, a structured-output mask on
    every row, top-k/p, min-p and logprobs: every intermediate a real step may hold."""
    from cvllm.layers.sampler import Sampler
    from cvllm.layers.sampling_tensors import SamplingTensors

    S, V = logits.shape
    hist = [[1, 2, 3]] * S
    words = -(-V // 32)
    t = SamplingTensors.from_lists(
        temperature=[0.7] * S, top_p=[0.9] * S, top_k=[50] * S, min_p=[0.05] * S,
        presence_penalty=[0.1] * S, frequency_penalty=[0.1] * S, repetition_penalty=[1.1] * S,
        seeds=[None] * S, output_index=[0] * S, prompt_token_ids=hist, output_token_ids=hist,
        vocab_size=V, device=device,
        # every row constrained: the structured-output mask's [S, V] intermediates too
        mask_rows=np.arange(S), bitmask=np.full((S, words), -1, dtype=np.int32),
    )
    Sampler()(logits, t, num_logprobs=5)


def measure(model: torch.nn.Module, specs: Sequence[LayerCacheSpec], *, block_size: int,
            num_tokens: int, max_seqs: int, max_len: int, decode_rows: int,
            device: torch.device, logit_rows: int = 0) -> MemoryProfile:
    """Profile the largest step (and, when ``decode_rows``, the largest captured step for
    the graph pool: ``decode_rows`` tokens, the LM head and a sampler pass on
    ``logit_rows`` of them, which covers the decode graphs' logits in the pool and their
    shared static copy), then read the device's totals."""
    lens = dummy_seq_lens(num_tokens, max_seqs, max_len)
    peak = profile_step_memory(model, specs, lens, block_size, max_seqs, device)
    margin = 0
    if decode_rows:
        margin = profile_step_memory(model, specs, [1] * decode_rows, block_size,
                                     min(logit_rows, decode_rows), device) + GRAPH_POOL_SLACK
    free, total = torch.cuda.mem_get_info(device)
    profile = MemoryProfile(
        total=int(total), non_torch=int(total - free - torch.cuda.memory_reserved(device)),
        weights=int(torch.cuda.memory_allocated(device)), peak_activation=peak,
        graph_margin=margin,
    )
    logger.info("memory: %.2f GiB total, weights %.2f GiB, peak step (%d tokens) %.2f GiB, "
                "CUDA graphs %.2f GiB, non-torch %.2f GiB", profile.total / _GIB,
                profile.weights / _GIB, sum(lens), peak / _GIB, margin / _GIB,
                profile.non_torch / _GIB)
    return profile

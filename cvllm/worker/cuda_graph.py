"""Pure-decode steps at padded batch sizes, replayed from CUDA graphs.

Built by the ``ModelRunner`` (every rank, CUDA only) after the KV cache is allocated,
when every attention layer's backend declares ``cuda_graphs`` (``graph_unsafe_reason``);
owned by that runner for the life of the engine. It owns:

- ``DecodeBuffers`` (``worker/decode_buffers.py``): the static device inputs of a
  decode step of up to ``max_bs`` rows (input_ids, positions, slot_mapping and
  block_tables of every KV group, seq_lens, state_slots), the pinned host staging they
  are filled from (one copy a narrow step), and the static ``sampled`` ids the next
  step's placeholders are patched from;
- one ``AttentionMetadata`` per capture size, built once from views of those buffers (no
  host sync, no copy: the graph reads whatever the buffers hold at replay);
- one ``torch.cuda.CUDAGraph`` per capture size (largest captured first, all sharing one
  memory pool), each above ``OWN_LOGITS_ROWS`` rows copying its logits into rows of one
  static ``[max_bs, V]`` buffer (the smaller ones keep their own).

A step runs here when every sequence decodes one token and the batch fits a capture
size (``padded_size``): ``run`` stages the step into the buffers, pads rows ``B..bs-1``
(token 0 at position 0, ``slot_mapping`` -1 so the K/V write skips them, ``seq_len`` 0 so
attention reads nothing and writes zeros), then replays that size's graph: the patch of
the placeholder ids, the forward, the LM head and, on CUDA, each row's max, argmax and
log-sum-exp for the sampler (an all-greedy step's ids are the argmax, left in ``sampled``
for the next step's patch) -- or, with
``--disable-cuda-graph`` (``capture=False``), launches the very same padded forward
eagerly. Both read the same metadata: ``decode_max_seq_len`` is ``max_model_len``, so the
Triton decode kernel's grid and split plan depend only on the padded size. The padded
shape, not the graph, decides the numbers, which is why outputs are identical with graphs
on and off. Every row is computed independently (GEMM rows, per-token norms and MoE
routing, per-sequence attention), so padding rows never disturb real ones.

The host copies in the metadata (``seq_lens_cpu``) hold bounds, not values: only
backends that never read them may run here (``graph_unsafe_reason`` checks it).
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np
import torch

from cvllm.attention.metadata import AttentionMetadata
from cvllm.attention.specs import FullAttentionSpec, LayerCacheSpec, SlidingWindowSpec
from cvllm.core.block_manager import cdiv
from cvllm.core.step_input import StepInput
from cvllm.distributed import comm, custom_allreduce
from cvllm.kernels import pdl
from cvllm.worker.decode_buffers import DecodeBuffers

logger = logging.getLogger("cvllm.worker")

CAPTURE_SIZE_LIMIT = 512
"""Largest batch captured (vLLM's default): bigger decode batches run eagerly, unpadded."""

OWN_LOGITS_ROWS = 8
"""Decode graphs of up to this many rows keep their own logits in the pool (4 MiB at 8
rows of a 128k vocabulary, float32) instead of copying them into the shared buffer: the
copy was a kernel of 2.7 us at the end of every batch-1 step (8B, H200)."""

def capture_sizes(max_num_seqs: int, limit: int = CAPTURE_SIZE_LIMIT) -> List[int]:
    """vLLM's capture sizes: 1, 2, 4, then every multiple of 8, up to ``max_num_seqs``
    (included even when not a multiple of 8) or ``limit``, ascending."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    top = min(max_num_seqs, limit)
    return [s for s in (1, 2, 4, *range(8, top + 1, 8)) if s < top] + [top]


def padded_batch_size(num_seqs: int, sizes: Sequence[int]) -> Optional[int]:
    """The smallest capture size that holds ``num_seqs`` rows; None when none does."""
    if num_seqs < 1:
        return None
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


def is_pure_decode(step: StepInput) -> bool:
    """Every sequence of the step computes exactly one new token."""
    num_seqs = int(step.seq_lens.shape[0])
    return (num_seqs > 0 and int(step.input_ids.shape[0]) == num_seqs
            and bool(np.all(np.diff(step.query_start_loc) == 1)))


def graph_unsafe_reason(model: torch.nn.Module, specs: Sequence[LayerCacheSpec]) -> Optional[str]:
    """Why decode steps of this model cannot be padded and captured; None when they can.
    MLA and linear-attention (state) layers plan on the host from the metadata's host
    arrays, as does any attention backend that does not declare ``cuda_graphs`` (the
    torch reference), so a capture would freeze one step's sizes into every replay."""
    from cvllm.layers.attention import Attention
    from cvllm.layers.moe import FusedMoE

    for i, spec in enumerate(specs):
        if not isinstance(spec, (FullAttentionSpec, SlidingWindowSpec)):
            return f"layer {i} keeps a {type(spec).__name__} cache"
    attns = [m for m in model.modules() if isinstance(m, Attention)]
    if not attns:
        return "the model has no paged attention layers"
    names = sorted({a.backend.name for a in attns if not a.backend.capabilities.cuda_graphs})
    if names:
        return f"attention backend {', '.join(names)} plans on the host"
    for m in model.modules():
        if isinstance(m, FusedMoE) and not m.quant_method.graph_safe:
            return f"{type(m.quant_method).__name__} picks its experts on the host"
    return None


def capture_agreed(sizes: Sequence[int], capture_one: Callable[[int], None],
                   fallback: str) -> bool:
    """``capture_one(size)`` for each size, largest first (the smaller ones reuse its
    pool). After each size every TP rank says whether its capture succeeded
    (``comm.agree_min``, a host collective each rank makes once per size, failed or not):
    when one rank's capture fails (out of memory, say; nothing communicates during a
    capture) all stop there, before the next size's warm-up runs its all-reduces, and
    every rank falls back alike. A rank that fails inside a warm-up forward, between two
    of its all-reduces, still leaves the others waiting in that collective. Returns
    whether every size was captured on every rank; False after a warning naming
    ``fallback``."""
    for size in sorted(sizes, reverse=True):
        error: Optional[BaseException] = None
        try:
            capture_one(size)
        except Exception as e:  # noqa: BLE001 - any failure falls back to eager, agreed
            error = e
        if comm.agree_min(int(error is None)) != 1:
            why = (f"{type(error).__name__}: {error}" if error is not None
                   else "another tensor-parallel rank's capture failed")
            logger.warning("CUDA graph capture failed at size %d (%s); %s", size, why,
                           fallback)
            return False
    return True


def patch_placeholders(input_ids: torch.Tensor, prev_rows: torch.Tensor,
                       prev_sampled: torch.Tensor) -> torch.Tensor:
    """``input_ids`` with each placeholder (``prev_rows >= 0``) replaced, on the device,
    by the id the previous step sampled at that row. All ``[T]`` int64."""
    taken = prev_sampled[prev_rows.clamp(min=0)]  # [T]
    return torch.where(prev_rows >= 0, taken, input_ids)


def patch_placeholders_(input_ids: torch.Tensor, prev_rows: torch.Tensor,
                        prev_sampled: torch.Tensor) -> torch.Tensor:
    """``patch_placeholders`` written into ``input_ids`` (one Triton launch on CUDA)."""
    if input_ids.is_cuda:
        from cvllm.kernels.transfer import patch_ids_

        return patch_ids_(input_ids, prev_rows, prev_sampled)
    return input_ids.copy_(patch_placeholders(input_ids, prev_rows, prev_sampled))


class CudaGraphRunner:
    """Padded decode steps for one runner: staging, metadata, capture and replay."""

    def __init__(self, model: torch.nn.Module, kv_caches: list, *, sizes: Sequence[int],
                 max_model_len: int, block_size: int, windows: Sequence[Optional[int]],
                 device: torch.device, capture: bool = True, sampled_rows: int = 0):
        self.model, self.kv_caches = model, kv_caches
        self.sizes = sorted(sizes)
        self.max_model_len = max_model_len
        self.windows = list(windows)
        self.device = device
        self.capture_enabled = capture and device.type == "cuda"
        self.buffers = DecodeBuffers(self.sizes[-1], cdiv(max_model_len, block_size),
                                     len(self.windows), device, sampled_rows=sampled_rows)
        self._metadata: Dict[int, AttentionMetadata] = {}
        self.graphs: Dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: Dict[int, torch.Tensor] = {}
        """Each graph's logits ``[bs, V]``. Above ``OWN_LOGITS_ROWS`` rows: rows of one
        static buffer, rewritten by every replay of any such size; each of those graphs
        copies its logits there, so the pool keeps no per-size logits (they were most of
        it: the decode graphs of an 8B Llama 3 at Q4_K and 256 sequences took 3,338 MiB
        with them, 1,334 MiB without, H200). Safe as a size's own output: a step's
        logits are read on the stream before the next step is launched. Smaller graphs
        keep their own, rewritten by their next replay."""
        self._logits: Optional[torch.Tensor] = None
        self._with_stats = False
        """The padded forward ends with ``row_stats`` (CUDA, float32 logits)."""
        self.pool = None
        """The graphs' memory pool once captured (the mixed-step graphs share it)."""

    def padded_size(self, step: StepInput) -> Optional[int]:
        """The size this step runs at here, or None for the eager path."""
        if not is_pure_decode(step):
            return None
        return padded_batch_size(int(step.seq_lens.shape[0]), self.sizes)

    def metadata(self, bs: int) -> AttentionMetadata:
        """The metadata of a padded step of ``bs`` rows: views of the static buffers, no
        device work (a replay sees the values staged by ``load``)."""
        meta = self._metadata.get(bs)
        if meta is not None:
            return meta
        b, L = self.buffers, self.max_model_len
        meta = AttentionMetadata(
            slot_mapping=b.slot_mapping[0][:bs], query_start_loc=b.query_start_loc[:bs + 1],
            seq_lens=b.seq_lens[:bs], block_tables=b.block_tables[0][:bs],
            max_query_len=1, max_seq_len=L, num_tokens=bs, query_lens=b.query_lens[:bs],
            num_decodes=bs, decode_max_seq_len=L, prefill_max_seq_len=0,
            prefill_max_query_len=0, query_start_loc_cpu=np.arange(bs + 1, dtype=np.int64),
            seq_lens_cpu=np.full(bs, L, dtype=np.int64),  # bounds, see the module docstring
            has_initial_state=b.has_initial_state[:bs], state_slots=b.state_slots[:bs],
            sliding_window=self.windows[0],
        )
        meta.groups[meta.sliding_window] = meta
        for g, window in enumerate(self.windows[1:], start=1):
            meta.groups[window] = dataclasses.replace(
                meta, slot_mapping=b.slot_mapping[g][:bs], block_tables=b.block_tables[g][:bs],
                sliding_window=window,
            )
        self._metadata[bs] = meta
        return meta

    def _forward(self, bs: int) -> torch.Tensor:
        """Logits ``[bs, V]`` float32: every row of a decode step samples, so the LM head
        (and its TP all-gather) runs inside the graph too. It starts by patching the
        placeholder rows from ``buffers.sampled`` and, on CUDA, ends with the rows'
        ``row_stats`` (greedy ids into ``buffers.sampled``): a greedy step launches
        nothing between its staging copy and the copy of its ids to the host."""
        b = self.buffers
        patch_placeholders_(b.input_ids[:bs], b.prev_rows[:bs], b.sampled)
        hidden = self.model(b.input_ids[:bs], b.positions[:bs], self.metadata(bs), self.kv_caches)
        logits = self.model.compute_logits(hidden)  # [bs, V]
        self._with_stats = logits.is_cuda and logits.dtype == torch.float32
        if self._with_stats:
            from cvllm.kernels.sampling import row_stats

            row_stats(logits, out=b.stats(bs))
        return logits

    def stats(self, rows: int) -> Optional[tuple]:
        """``(max, argmax, lse)`` ``[rows]`` of the last padded step's logits (CUDA, float32
        logits), which the sampler takes instead of computing them; else None."""
        return self.buffers.stats(rows) if self._with_stats else None

    def run(self, step: StepInput, bs: int, prev_sampled: Optional[torch.Tensor] = None
            ) -> torch.Tensor:
        """Logits ``[bs, V]`` (float32) of the step padded to ``bs``; rows past the
        step's B are padding. The output is rewritten by the next replay of any size.
        ``prev_sampled``: the previous step's sampled ids, patched over the placeholder
        rows (``step.prev_rows``) on the device, inside the graph (``buffers.take_prev``
        puts them where it reads them unless they are there already)."""
        self.buffers.load(step, bs)
        if prev_sampled is not None:
            self.buffers.take_prev(prev_sampled)
        graph = self.graphs.get(bs)
        if graph is None:
            return self._forward(bs)
        graph.replay()
        return self.outputs[bs]

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first so the smaller ones reuse its pool. The
        buffers hold padding only (slot -1, seq_len 0), so capturing writes no KV. A
        failed capture leaves every size eager (padded), with a warning."""
        if not self.capture_enabled:
            return
        torch.cuda.synchronize(self.device)
        pool = self.pool = torch.cuda.graph_pool_handle()

        def capture_one(bs: int) -> None:
            with pdl.graph_launches():  # the launch options the capture will use
                warm = self._forward(bs)  # warm-up: compiles kernels, moves lazy buffers
                if self._logits is None and bs > OWN_LOGITS_ROWS:  # the largest, outside the pool
                    self._logits = torch.empty((self.sizes[-1],) + warm.shape[1:],
                                               dtype=warm.dtype, device=warm.device)
                del warm
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                if bs <= OWN_LOGITS_ROWS:
                    out = self._forward(bs)  # kept in the pool
                else:
                    out = self._logits[:bs]
                    out.copy_(self._forward(bs))  # the size's own logits die in the pool
            self.graphs[bs], self.outputs[bs] = graph, out

        if not capture_agreed(self.sizes, capture_one, "decode steps run eagerly"):
            fast = custom_allreduce.active()
            if fast is not None:  # a push recorded in the failed capture never ran
                fast.forget_push()
            self.graphs.clear()
            self.outputs.clear()
            self._logits = None
        torch.cuda.synchronize(self.device)

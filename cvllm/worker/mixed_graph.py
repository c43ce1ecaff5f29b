"""Steps that compute prompt tokens, up to ``--cuda-graph-max-tokens`` tokens, replayed
from CUDA graphs piece by piece, with the attention launched eagerly between the pieces.

Built by the ``ModelRunner`` (every rank, CUDA only) beside the decode graphs
(``worker/cuda_graph.py``) when the model is graph-safe (``graph_unsafe_reason``); owned by
that runner. Why: a step with prompt tokens (a new prompt's chunk, a prefix-cache hit's
short suffix, and every decode that shares the step with them) used to run eagerly, and
its ~290 launches for an 8B model held the host for 18-21 ms against about 8 ms of GPU
work (``docs/adr/mixed-step-cuda-graphs.md``).

How (vLLM's piecewise graphs, done by the runner for every model family, where every
attention backend declares ``split_graphs``): for each token size T of ``token_sizes``
the model's forward runs once under ``layers.attention.split_at_attention`` (set on this
runner's model only). Each ``Attention.forward`` call ends the graph
being captured, is recorded as a hole, and starts the next graph: a model of L attention
layers gives L + 1 graphs (embedding, layer 0 up to its QKV projection; layer i's output
projection, MLP and norm up to layer i+1's QKV; ...; the final norm). The hole's query,
key, value (and positions, unless they are the static input) are copied inside the graph
into static buffers shared by every layer and size, and its output is one static buffer
the next piece reads: the graphs hold no per-layer activations between them. A replay
runs piece 0, hole 0, piece 1, ..., piece L; a hole is ``Attention.attend`` on the static
buffers with the step's real ``AttentionMetadata``: the rotary + K/V write, decode and
prefill attention of the Triton backend, 3-5 launches, with the real sequence lengths
and block tables, so one capture serves every mix of prefills and decodes of that size.

A step of ``n`` tokens runs at the smallest size ``T >= n``: rows ``n..T-1`` are padding
(token 0 at position 0; the K/V write takes only the step's ``n`` slots and the attention
zeroes their outputs), and every other op is row-wise, so they never disturb real rows.
The LM head runs after the replay, on the sampled rows only (eagerly, as before). With
``--disable-cuda-graph`` the same padded forward runs eagerly, so outputs do not change
with graphs on or off (the decode graphs' rule). Graphs share the decode graphs' memory
pool; they are captured after them, largest size first.
"""

from __future__ import annotations

import logging
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from cvllm.attention.metadata import AttentionMetadata
from cvllm.core.block_manager import cdiv
from cvllm.core.step_input import StepInput
from cvllm.core.wire_format import StepInputError
from cvllm.distributed import custom_allreduce
from cvllm.kernels import pdl
from cvllm.layers.attention import Attention, split_at_attention
from cvllm.worker.cuda_graph import capture_agreed, is_pure_decode, patch_placeholders_

logger = logging.getLogger("cvllm.worker")

DEFAULT_MAX_TOKENS = 512
"""``--cuda-graph-max-tokens``' default (vLLM's largest capture size): longer steps are
GPU-bound, their launches hide behind the GPU's work."""


def token_sizes(max_tokens: int, step_budget: int) -> List[int]:
    """Capture sizes of mixed steps: 16, 32, 64, ... up to ``max_tokens`` and no more than a
    step can hold (``step_budget``, included when smaller); empty when ``max_tokens`` is 0."""
    top = min(max_tokens, step_budget)
    if top <= 0:
        return []
    sizes, t = [], 16
    while t < top:
        sizes.append(t)
        t *= 2
    return sizes + [top]


def split_unsafe_reason(model: torch.nn.Module) -> Optional[str]:
    """Why this model's steps with prompt tokens cannot be captured piece by piece; None
    when every attention layer's backend declares ``split_graphs``."""
    names = sorted({m.backend.name for m in model.modules()
                    if isinstance(m, Attention) and not m.backend.capabilities.split_graphs})
    if not names:
        return None
    return f"attention backend {', '.join(names)} cannot run between graph pieces"


class _Hole:
    """One attention call between two pieces: the layer, its cache and rotary, and the
    static tensors its inputs were copied into."""

    __slots__ = ("layer", "kv_cache", "rotary_emb", "query", "key", "value", "positions", "out")

    def __init__(self, layer: Attention, kv_cache, rotary_emb, query, key, value, positions, out):
        self.layer, self.kv_cache, self.rotary_emb = layer, kv_cache, rotary_emb
        self.query, self.key, self.value = query, key, value
        self.positions, self.out = positions, out

    def run(self, meta: AttentionMetadata) -> None:
        self.layer.attend(self.query, self.key, self.value, self.kv_cache, meta,
                          self.positions, self.rotary_emb, out=self.out)


class _StaticPool:
    """Static ``[max_tokens, width]`` buffers by (role, width, dtype), shared by every
    layer and size (a layer's hole is done with them before the next layer's piece
    writes them again)."""

    def __init__(self, max_tokens: int, device: torch.device):
        self.max_tokens, self.device = max_tokens, device
        self._bufs: Dict[Tuple, torch.Tensor] = {}

    def get(self, role: str, T: int, like: torch.Tensor) -> torch.Tensor:
        width = int(np.prod(like.shape[1:])) if like.dim() > 1 else 1
        key = (role, width, like.dtype)
        buf = self._bufs.get(key)
        if buf is None:
            buf = self._bufs[key] = torch.zeros(self.max_tokens, width, dtype=like.dtype,
                                                device=self.device)
        return buf[:T].view(T, *like.shape[1:])

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._bufs.values())


class MixedGraphRunner:
    """Padded steps with prompt tokens for one runner: staging, capture and replay."""

    def __init__(self, model: torch.nn.Module, kv_caches: list, *, sizes: Sequence[int],
                 block_size: int, windows: Sequence[Optional[int]], device: torch.device,
                 capture: bool = True):
        if not sizes:
            raise ValueError("no mixed-step sizes")
        self.model, self.kv_caches = model, kv_caches
        self.sizes = sorted(sizes)
        self.block_size, self.windows, self.device = block_size, list(windows), device
        self.capture_enabled = capture and device.type == "cuda"
        top = self.sizes[-1]
        cuda = device.type == "cuda"
        self._host = torch.zeros(3, top, dtype=torch.int64, pin_memory=cuda)  # ids | positions | prev_rows
        self._dev = self._host.to(device)  # [3, top]
        self.input_ids, self.positions, self.prev_rows = self._dev[0], self._dev[1], self._dev[2]
        self._staged = torch.cuda.Event() if cuda else None
        """Recorded after the staging copy: the pinned buffer is free again once it fires."""
        self._statics = _StaticPool(top, device)
        self.graphs: Dict[int, List[torch.cuda.CUDAGraph]] = {}
        self.holes: Dict[int, List[_Hole]] = {}
        self.outputs: Dict[int, torch.Tensor] = {}
        """Each size's hidden states ``[T, hidden]``, rewritten by every replay."""

    # ------------------------------------------------------------------ steps
    def padded_size(self, step: StepInput) -> Optional[int]:
        """The size a step with prompt tokens runs at here, or None (eager, unpadded)."""
        n = int(step.input_ids.shape[0])
        if n == 0 or n > self.sizes[-1] or is_pure_decode(step):
            return None
        return next(t for t in self.sizes if t >= n)

    def run(self, step: StepInput, T: int, meta: AttentionMetadata,
            prev_sampled: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` of the step padded to ``T`` tokens (rows past its
        ``n`` are padding; the tensor is rewritten by the size's next replay). ``meta``:
        the step's own metadata (``n`` tokens). ``prev_sampled``: the previous step's ids,
        patched over the placeholder rows on the device."""
        self._stage(step, T)
        if prev_sampled is not None:
            patch_placeholders_(self.input_ids[:T], self.prev_rows[:T], prev_sampled)
        pieces = self.graphs.get(T)
        if pieces is None:  # not captured (--disable-cuda-graph, or a failed capture)
            return self.model(self.input_ids[:T], self.positions[:T], meta, self.kv_caches)
        for piece, hole in zip(pieces, self.holes[T]):
            piece.replay()
            hole.run(meta)
        pieces[-1].replay()
        return self.outputs[T]

    def _stage(self, step: StepInput, T: int) -> None:
        n = int(step.input_ids.shape[0])
        if not 0 < n <= T <= self.sizes[-1]:
            raise StepInputError(f"step {step.step_id} has {n} tokens; size {T} cannot hold it")
        if self._staged is not None:
            self._staged.synchronize()  # the previous step's copy may still read it
        h = self._host.numpy()
        h[0, :n], h[0, n:T] = step.input_ids, 0
        h[1, :n], h[1, n:T] = step.positions, 0
        h[2, :n], h[2, n:T] = step.prev_rows, -1
        # the whole buffer (12 KiB at 512): a strided copy would stage through pageable
        # memory, and such a copy waits for the stream (the step in flight)
        self._dev.copy_(self._host, non_blocking=True)
        if self._staged is not None:
            self._staged.record()

    # ---------------------------------------------------------------- capture
    def _capture_metadata(self, T: int) -> AttentionMetadata:
        """One sequence of ``T`` new tokens whose slots are all -1 (the warm-up writes no
        K/V): what the warm-up forward attends with. The capture itself launches no
        attention."""
        nb = cdiv(T, self.block_size)
        tables = np.zeros((1, nb), dtype=np.int64)
        slots = np.full(T, -1, dtype=np.int64)
        return AttentionMetadata.build(
            slot_mapping=slots, query_start_loc=np.array([0, T]), seq_lens=np.array([T]),
            block_tables=tables, device=self.device, sliding_window=self.windows[0],
            extra_groups=[(w, slots, tables) for w in self.windows[1:]],
            state_slots=np.array([-1]))

    def _static_inputs(self, T: int, query, key, value, positions):
        """The hole's inputs as static tensors: copies (captured in the current piece)
        into the shared buffers, the static positions as they are. Query, key and value
        split from one fused projection (``[T, W]``, contiguous) take one copy of it."""
        def static(role: str, x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
            if x is None:
                return None
            if x.data_ptr() == self.positions.data_ptr() and x.shape[0] == T:
                return x
            buf = self._statics.get(role, T, x)
            buf.copy_(x)
            return buf

        base = query._base
        if (base is not None and key is not None and value is not None and key._base is base
                and value._base is base and base.dim() == 2 and base.shape[0] == T
                and base.is_contiguous()):
            buf = static("qkv", base)  # [T, W]

            def view(x: torch.Tensor) -> torch.Tensor:
                return buf.as_strided(x.shape, x.stride(), buf.storage_offset()
                                      + x.storage_offset() - base.storage_offset())
            return view(query), view(key), view(value), static("positions", positions)
        return (static("query", query), static("key", key), static("value", value),
                static("positions", positions))

    @torch.inference_mode()
    def capture(self, pool=None) -> None:
        """Capture every size, largest first, into ``pool`` (the decode graphs'; a new one
        by default). A failed capture (on any TP rank: ``capture_agreed``) leaves every
        size eager (padded), with a warning; what it grew in the shared pool stays
        reserved while the decode graphs hold the pool."""
        if not self.capture_enabled:
            return
        torch.cuda.synchronize(self.device)
        pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        if not capture_agreed(self.sizes, lambda T: self._capture_size(T, pool, stream),
                              "steps with prompt tokens run eagerly, padded"):
            fast = custom_allreduce.active()
            if fast is not None:
                fast.forget_push()
            self.graphs.clear()
            self.holes.clear()
            self.outputs.clear()
        torch.cuda.synchronize(self.device)

    def warm_up(self, T: int) -> torch.Tensor:
        """The size's forward run once as its replays will run it (the pieces' kernels
        with the graphs' launch options, the attention eagerly on the static buffers),
        on padding only: it compiles what the capture needs and writes no K/V. Returns
        the hidden states ``[T, hidden]``."""
        meta = self._capture_metadata(T)
        ids, pos = self.input_ids[:T], self.positions[:T]
        ids.zero_()
        pos.zero_()

        def warm(layer, query, key, value, kv_cache, attn_metadata, positions, rotary_emb):
            q, k, v, p = self._static_inputs(T, query, key, value, positions)
            out = self._statics.get("out", T, query)
            with pdl.eager_launches():  # as every replay launches it
                return layer.attend(q, k, v, kv_cache, attn_metadata, p, rotary_emb, out=out)

        with pdl.graph_launches(), split_at_attention(self.model, warm):
            return self.model(ids, pos, meta, self.kv_caches)

    def _capture_size(self, T: int, pool, stream: torch.cuda.Stream) -> None:
        self.warm_up(T)
        torch.cuda.synchronize(self.device)
        meta = self._capture_metadata(T)
        ids, pos = self.input_ids[:T], self.positions[:T]

        pieces: List[torch.cuda.CUDAGraph] = []
        holes: List[_Hole] = []

        def begin() -> None:
            pieces.append(torch.cuda.CUDAGraph())
            pieces[-1].capture_begin(pool=pool)

        def hole(layer, query, key, value, kv_cache, attn_metadata, positions, rotary_emb):
            q, k, v, p = self._static_inputs(T, query, key, value, positions)
            out = self._statics.get("out", T, query)
            pieces[-1].capture_end()
            holes.append(_Hole(layer, kv_cache, rotary_emb, q, k, v, p, out))
            begin()
            return out.view(T, -1)  # attend's [T, H*D], whatever the query's shape

        stream.wait_stream(torch.cuda.current_stream(self.device))  # before it is current
        with torch.cuda.stream(stream):
            begin()
            try:
                with split_at_attention(self.model, hole):
                    hidden = self.model(ids, pos, meta, self.kv_caches)
            finally:
                pieces[-1].capture_end()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        if len(pieces) != len(holes) + 1 or not holes:
            raise RuntimeError(f"the forward made {len(holes)} attention calls")
        self.graphs[T], self.holes[T], self.outputs[T] = pieces, holes, hidden

    def static_bytes(self) -> int:
        return self._statics.nbytes() + self._dev.numel() * 8

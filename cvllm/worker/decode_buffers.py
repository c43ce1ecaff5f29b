"""The static inputs of a padded decode step: device buffers, their pinned host staging,
and the sampled ids the next step's placeholders are patched from.

Built by the ``CudaGraphRunner`` (``worker/cuda_graph.py``; every rank, CUDA, graph-safe
models) for its largest capture size and owned by it for the life of the engine: its
graphs and its per-size ``AttentionMetadata`` are views of these buffers, so ``load``
(called by ``CudaGraphRunner.run`` before each replay) is all a step writes. Rows past a
step's own are staged as padding (token 0 at position 0, ``slot_mapping`` -1, ``seq_len``
0) so they write and read nothing.
"""

from __future__ import annotations

import numpy as np
import torch

from cvllm.attention.metadata import PAD_SLOT_ID
from cvllm.core.step_input import StepInput
from cvllm.core.wire_format import StepInputError

DIRECT_TABLE_BYTES = 64 << 10
"""A step whose block tables take at most this many bytes at the buffers' full width
(all its rows, every KV group) copies them straight into place with its other inputs:
one host-to-device copy a step, nothing else outside the graph. A larger one copies them
compact and spreads them on the device (a second copy, and one device copy a group)."""


class DecodeBuffers:
    """Static device inputs of a padded decode step, rows ``0..max_bs-1``, the host
    staging they are copied from (pinned on CUDA), and the step's sampled ids.

    One byte buffer on each side holds, in order: the int64 inputs (ids, positions,
    placeholder rows, each group's slots), the int32 ``seq_lens``, the block tables as
    ``[max_bs, G, M]`` (``block_tables[g]`` is a view with row stride ``G * M``, so rows
    ``0..bs-1`` of every group are one span) and a compact ``[G, bs, m]`` staging area
    for steps too wide for ``DIRECT_TABLE_BYTES``.

    ``sampled`` (``[max(max_bs, sampled_rows)]`` int64, device only) holds the previous
    step's sampled ids: a padded forward first patches its placeholder rows from it, and
    on CUDA ends by writing its own greedy ids (the argmax of each row) into it, beside
    ``row_max`` and ``lse`` -- all inside the graph."""

    def __init__(self, max_bs: int, max_blocks: int, num_groups: int, device: torch.device,
                 sampled_rows: int = 0):
        self.max_bs, self.max_blocks, self.num_groups = max_bs, max_blocks, num_groups
        self.device = device
        cuda = device.type == "cuda"
        G, M = num_groups, max_blocks
        self._off32 = (3 + G) * max_bs * 8  # bytes: seq_lens
        self._off_tables = self._off32 + max_bs * 4
        self._off_compact = self._off_tables + max_bs * G * M * 4
        host = torch.zeros(self._off_compact + G * max_bs * M * 4, dtype=torch.uint8,
                           pin_memory=cuda)
        host[:self._off32].view(torch.int64)[2 * max_bs:] = PAD_SLOT_ID  # every row pads
        self._host, self._dev = host, host.to(device)
        self._h64 = host[:self._off32].view(torch.int64).numpy()
        self._h32 = host[self._off32:self._off_tables].view(torch.int32).numpy()
        self._htables = (host[self._off_tables:self._off_compact].view(torch.int32)
                         .numpy().reshape(max_bs, G, M))
        self._hcompact = host[self._off_compact:].view(torch.int32).numpy()
        i64 = self._dev[:self._off32].view(torch.int64)
        self.input_ids = i64[:max_bs]  # [max_bs]
        self.positions = i64[max_bs:2 * max_bs]  # [max_bs]
        self.prev_rows = i64[2 * max_bs:3 * max_bs]  # [max_bs], -1: the id is staged
        self.slot_mapping = [i64[(3 + g) * max_bs:(4 + g) * max_bs]
                             for g in range(G)]  # G x [max_bs]
        self.seq_lens = self._dev[self._off32:self._off_tables].view(torch.int32)  # [max_bs]
        tables = self._dev[self._off_tables:self._off_compact].view(torch.int32)
        self.block_tables = [tables.view(max_bs, G, M)[:, g] for g in range(G)]  # G x [max_bs, M]
        self._compact = self._dev[self._off_compact:].view(torch.int32)
        self.query_start_loc = torch.arange(max_bs + 1, dtype=torch.int32, device=device)
        self.query_lens = torch.ones(max_bs, dtype=torch.int32, device=device)
        self.has_initial_state = torch.ones(max_bs, dtype=torch.bool, device=device)
        self.state_slots = torch.full((max_bs,), -1, dtype=torch.int64, device=device)
        self.sampled = torch.zeros(max(max_bs, sampled_rows), dtype=torch.int64, device=device)
        self.row_max = torch.zeros(max_bs, dtype=torch.float32, device=device)
        self.lse = torch.zeros(max_bs, dtype=torch.float32, device=device)
        self._staged = torch.cuda.Event() if cuda else None
        """Recorded after the host-to-device copies: the staging is free again once it fires."""
        self.num_copies = 0
        """Host-to-device copies made so far (tests check a narrow step makes one)."""

    def load(self, step: StepInput, bs: int) -> None:
        """Stage ``step`` (B <= bs pure-decode rows) into rows ``0..bs-1``; rows B.. pad."""
        B, mb, G, M = int(step.seq_lens.shape[0]), self.max_bs, self.num_groups, self.max_blocks
        m = int(step.block_tables.shape[1]) if step.block_tables.ndim == 2 else 0
        if not B <= bs <= mb or m > M or step.num_kv_groups != G:
            raise StepInputError(f"step {step.step_id} ({B} rows, {m} block columns, "
                                 f"{step.num_kv_groups} KV groups) does not fit the decode "
                                 f"buffers ({mb} rows, {M} columns, {G} groups) at size {bs}")
        if self._staged is not None:
            self._staged.synchronize()  # the previous step's copies may still read it
        h64, direct = self._h64, bs * G * M * 4 <= DIRECT_TABLE_BYTES
        _fill(h64[:bs], step.input_ids, 0)
        _fill(h64[mb:mb + bs], step.positions, 0)
        _fill(h64[2 * mb:2 * mb + bs], step.prev_rows, -1)
        _fill(self._h32[:bs], step.seq_lens, 0)
        for g in range(G):
            _, slots, tables = step.kv_group(g)
            _fill(h64[(3 + g) * mb:(3 + g) * mb + bs], slots, PAD_SLOT_ID)
            view = (self._htables[:bs, g, :m] if direct
                    else self._hcompact[g * bs * m:(g + 1) * bs * m].reshape(bs, m))  # [bs, m]
            np.maximum(tables, 0, out=view[:B])  # freed sliding blocks (-1) read block 0
            view[B:] = 0
        if direct:  # columns past m keep earlier block ids: no row reads past its seq_len
            self._copy(0, self._off_tables + bs * G * M * 4)
        else:
            self._copy(0, self._off_tables)
            self._copy(self._off_compact, self._off_compact + G * bs * m * 4)
        if self._staged is not None:
            self._staged.record()
        if not direct:
            for g in range(G):  # device-side: spread [bs, m] into [max_bs, M]
                src = self._compact[g * bs * m:(g + 1) * bs * m].view(bs, m)
                self.block_tables[g][:bs, :m].copy_(src)

    def _copy(self, lo: int, hi: int) -> None:
        self._dev[lo:hi].copy_(self._host[lo:hi], non_blocking=True)
        self.num_copies += 1

    def take_prev(self, prev: torch.Tensor) -> None:
        """Put the previous step's sampled ids (``[S]`` int64, on this device) where the
        padded forward patches placeholders from; nothing to do when they are already
        there (a greedy step sampled in the graph)."""
        if prev.data_ptr() == self.sampled.data_ptr():
            return
        n = int(prev.shape[0])
        if n > self.sampled.shape[0]:
            raise StepInputError(f"the previous step sampled {n} rows; the decode buffers "
                                 f"hold {self.sampled.shape[0]}")
        self.sampled[:n].copy_(prev)

    def stats(self, rows: int) -> tuple:
        """The padded forward's ``(max, argmax, lse)`` of its first ``rows`` logits rows
        (CUDA; ``kernels/sampling.row_stats``), each ``[rows]``."""
        return self.row_max[:rows], self.sampled[:rows], self.lse[:rows]


def _fill(dst: np.ndarray, values: np.ndarray, pad: int) -> None:
    n = values.shape[0]
    dst[:n] = values
    dst[n:] = pad


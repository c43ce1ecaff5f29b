"""Per-step sampling inputs on the logits' device: ``SamplingTensors``.

Built on rank 0 once per step by the model runner with ``SamplingTensors.from_lists``
from the step's per-row values (``StepInput``) and rank 0's ``SamplingBatch`` (token
histories, structured-output bitmask); read by ``Sampler`` (``layers/sampler.py``) for
that one step. Host-side flags say which stages a step needs, so an all-greedy step with
no penalty copies nothing and launches no stage it skips.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch

from cvllm.kernels.transfer import to_device

_GREEDY_EPS = 1e-5


def _device_row(table: int, row: Optional[int], doc: str) -> property:
    """A per-row value of ``SamplingTensors``: row ``row`` of its device table ``table``
    (``_device_values``; None: the whole table), copied to the device when first read."""
    def get(self) -> torch.Tensor:
        values = self._device_values()[table]
        return values if row is None else values[row]
    return property(get, doc=doc)



@dataclass
class SamplingTensors:
    """Per-row sampling values of one step, on the logits' device (rank 0). The per-row
    values (``temperature`` .. ``is_greedy``) go to the device on first use, in two
    pinned copies: a step whose rows are all greedy, with no penalty, reads none of
    them and copies nothing (batch-1 greedy decode: two copies and a kernel less a step)."""

    host_floats: np.ndarray
    """[6, S] float32: temperature (greedy rows hold 1.0: they never divide), top_p, min_p,
    presence, frequency and repetition penalties."""
    host_ints: np.ndarray
    """[2, S] int64: top_k (V where disabled), greedy (0 / 1)."""
    device: torch.device
    output_counts: Optional[torch.Tensor]
    """[S, V] int32 occurrences of each token in the output; None when no row penalizes."""
    prompt_mask: Optional[torch.Tensor]
    """[S, V] bool, token present in the prompt; None when no row has a repetition penalty."""
    seeds: List[Optional[int]]
    """Host-side per-row seeds (None: the sampler's global generator)."""
    output_index: List[int]
    """Host-side number of tokens each row generated before this step."""
    greedy: List[bool]
    """Host-side copy of ``is_greedy``."""
    # Host-side flags, so unused stages cost nothing and never need a device sync.
    all_greedy: bool
    any_greedy: bool
    do_top_k: bool
    do_top_p: bool
    do_min_p: bool
    do_repetition: bool
    do_freq_presence: bool
    max_top_k: int = 0
    """Largest top-k of the sampled rows, V where one has none: the columns the GPU
    sampler must rank (host-side, so choosing ``topk`` over a full sort needs no sync)."""
    mask_rows: Optional[torch.Tensor] = None
    """[R] int64 rows constrained by structured output; None when no row is."""
    allowed: Optional[torch.Tensor] = None
    """[R, V] bool, the tokens each constrained row may take (from the bitmask)."""

    _values: Optional[tuple] = field(default=None, repr=False, compare=False)

    def _device_values(self) -> tuple:
        if self._values is None:
            floats = to_device(self.host_floats, self.device)  # [6, S]
            ints = to_device(self.host_ints, self.device)  # [2, S]
            self._values = (floats, ints, ints[1].bool())
        return self._values

    temperature = _device_row(0, 0, "[S] float32; greedy rows hold 1.0 (they never divide)")
    top_p = _device_row(0, 1, "[S] float32")
    min_p = _device_row(0, 2, "[S] float32")
    presence_penalty = _device_row(0, 3, "[S] float32")
    frequency_penalty = _device_row(0, 4, "[S] float32")
    repetition_penalty = _device_row(0, 5, "[S] float32")
    top_k = _device_row(1, 0, "[S] int64; V where disabled")
    is_greedy = _device_row(2, None, "[S] bool")

    @property
    def num_rows(self) -> int:
        return len(self.seeds)

    @classmethod
    def from_lists(
        cls,
        temperature: Sequence[float], top_p: Sequence[float], top_k: Sequence[int],
        min_p: Sequence[float],
        presence_penalty: Sequence[float], frequency_penalty: Sequence[float],
        repetition_penalty: Sequence[float],
        seeds: Sequence[Optional[int]], output_index: Sequence[int],
        prompt_token_ids: Sequence[Sequence[int]], output_token_ids: Sequence[Sequence[int]],
        vocab_size: int, device: torch.device | str,
        mask_rows: Optional[np.ndarray] = None, bitmask: Optional[np.ndarray] = None,
    ) -> "SamplingTensors":
        """One step's rows: the values on the host (to the device when first read), the
        flags that skip unused stages, and only the device tensors a row needs (token
        histories of penalized rows, the bitmask of constrained ones)."""
        columns = [temperature, top_p, top_k, min_p, presence_penalty, frequency_penalty,
                   repetition_penalty, seeds, output_index, prompt_token_ids, output_token_ids]
        num_rows = len(temperature)
        if any(len(c) != num_rows for c in columns):
            lengths = [len(c) for c in columns]
            raise ValueError(f"sampling lists disagree on the row count: {lengths}")
        greedy = [t < _GREEDY_EPS for t in temperature]
        # Disabled top-k becomes V so that the masking below is a no-op for that row.
        ks = [k if 0 < k < vocab_size else vocab_size for k in top_k]
        rep = [r != 1.0 for r in repetition_penalty]
        fp = [f != 0.0 or p != 0.0 for f, p in zip(frequency_penalty, presence_penalty)]
        # Greedy rows skip temperature/top-k/top-p/min-p; their values are neutralized.
        sampled = [not g for g in greedy]

        # The per-row values go to the device in two pinned copies (kernels/transfer.py),
        # when first read.
        floats = np.array([[1.0 if g else t for g, t in zip(greedy, temperature)],
                           top_p, min_p, presence_penalty, frequency_penalty,
                           repetition_penalty], dtype=np.float32).reshape(6, num_rows)
        ints = np.array([ks, greedy], dtype=np.int64).reshape(2, num_rows)
        rows = allowed = output_counts = prompt_mask = None
        if bitmask is not None and mask_rows is not None and len(mask_rows):
            rows, allowed = _mask_tensors(mask_rows, bitmask, vocab_size, device)
        if any(rep) or any(fp):
            output_counts, prompt_mask = _history_tensors(
                prompt_token_ids, output_token_ids, rep, fp, vocab_size, device)
        return cls(
            host_floats=floats, host_ints=ints, device=torch.device(device),
            output_counts=output_counts, prompt_mask=prompt_mask,
            seeds=list(seeds), output_index=[int(i) for i in output_index], greedy=greedy,
            all_greedy=all(greedy), any_greedy=any(greedy),
            do_top_k=any(s and k < vocab_size for s, k in zip(sampled, ks)),
            do_top_p=any(s and p < 1.0 for s, p in zip(sampled, top_p)),
            do_min_p=any(s and m > 0.0 for s, m in zip(sampled, min_p)),
            do_repetition=any(rep), do_freq_presence=any(fp),
            max_top_k=max((k for s, k in zip(sampled, ks) if s), default=vocab_size),
            mask_rows=rows, allowed=allowed,
        )


def _mask_tensors(mask_rows: np.ndarray, bitmask: np.ndarray, vocab_size: int,
                  device: torch.device | str) -> Tuple[torch.Tensor, torch.Tensor]:
    """The constrained rows ``[R]`` int64 and the tokens each may take ``[R, V]`` bool."""
    rows = to_device(np.asarray(mask_rows, dtype=np.int64), device)  # [R]
    allowed = unpack_bitmask(to_device(bitmask, device), vocab_size)  # [R, V]
    return rows, allowed


def _history_tensors(prompt_token_ids: Sequence[Sequence[int]],
                     output_token_ids: Sequence[Sequence[int]], rep: List[bool],
                     fp: List[bool], vocab_size: int, device: torch.device | str
                     ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``output_counts`` [S, V] and, when a row has a repetition penalty, ``prompt_mask``
    [S, V] (``rep`` / ``fp``: which rows have a repetition / frequency-presence penalty)."""
    # Only rows that penalize contribute ids: the others' histories are never read.
    out_ids = [o if (r or q) else () for o, r, q in zip(output_token_ids, rep, fp)]
    output_counts = _token_counts(out_ids, vocab_size, device)  # [S, V]
    prompt_mask = None
    if any(rep):
        prompt_ids = [p if r else () for p, r in zip(prompt_token_ids, rep)]
        prompt_mask = _token_counts(prompt_ids, vocab_size, device) > 0  # [S, V]
    return output_counts, prompt_mask



_BIT_SHIFTS: dict = {}


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[R, W]`` int32 (bit j of word i allows token 32 i + j) -> ``[R, V]`` bool. A row
    that allows nothing (a grammar engine fault) allows everything instead, so sampling
    never meets a row of -inf; the engine's matcher then rejects the token and ends it."""
    key = bitmask.device
    shifts = _BIT_SHIFTS.get(key)
    if shifts is None:
        shifts = _BIT_SHIFTS[key] = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    R, W = bitmask.shape
    if W * 32 < vocab_size:
        raise ValueError(f"a bitmask of {W} words cannot cover {vocab_size} tokens")
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [R, W, 32]
    allowed = bits.reshape(R, W * 32)[:, :vocab_size].bool()  # [R, V]
    return allowed | ~allowed.any(dim=-1, keepdim=True)


def _token_counts(rows: Sequence[Sequence[int]], vocab_size: int,
                  device: torch.device | str) -> torch.Tensor:
    """Occurrences of each token id per row, via one scatter_add on padded ids."""
    num_rows = len(rows)
    max_len = max((len(r) for r in rows), default=0)
    # Padding points at an extra column V that is dropped afterwards.
    padded = np.full((num_rows, max(max_len, 1)), vocab_size, dtype=np.int64)  # [S, L]
    for i, r in enumerate(rows):
        padded[i, : len(r)] = r
    ids = to_device(padded, device)  # [S, L]
    counts = torch.zeros(num_rows, vocab_size + 1, dtype=torch.int32, device=device)  # [S, V+1]
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.int32))
    return counts[:, :vocab_size]  # [S, V]

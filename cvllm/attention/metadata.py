"""AttentionMetadata: the device tensors the attention backends read, for one step.

Built once per step by the worker (``ModelRunner.execute``, on every rank) from the
``StepInput`` numpy arrays with one host-to-device copy each, then passed explicitly
through ``model.forward`` to every attention layer. Read-only after ``build``; nothing
else owns it beyond the step.

Token order is the scheduler's: sequence ``b`` owns the query tokens
``query_start_loc[b] : query_start_loc[b+1]``, at positions
``seq_lens[b] - query_len_b .. seq_lens[b] - 1``. Decode sequences (one new token) come
first; the backends use ``num_decodes`` to split the batch into an all-decode head and a
prefill tail (a tail that still holds single-token rows is handled correctly, just
slower). Tokens past ``num_tokens`` (padding, e.g. for CUDA graphs) are ignored.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

PAD_SLOT_ID = -1
"""slot_mapping value of a padding token: nothing is written for it."""


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: cache slot (block_id * block_size + offset) per token
    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32: context length incl. this step's tokens
    block_tables: torch.Tensor  # [B, M] int32 (padding entries clamped to block 0)
    max_query_len: int
    max_seq_len: int
    num_tokens: int
    """Real (unpadded) tokens in the step: ``query_start_loc[-1]``."""
    # Derived on the host in ``build`` so backends never sync to learn a size.
    query_lens: torch.Tensor  # [B] int32
    num_decodes: int
    """Leading sequences with exactly one query token (their tokens are 0..num_decodes-1)."""
    decode_max_seq_len: int
    """Longest context among the leading decode sequences (0 when none)."""
    prefill_max_seq_len: int
    """Longest context among the other sequences (0 when none)."""
    prefill_max_query_len: int
    """Most query tokens of one of the other sequences (0 when none)."""
    query_start_loc_cpu: np.ndarray  # [B+1] int64 host copy, for host-side planning
    seq_lens_cpu: np.ndarray  # [B] int64 host copy

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @classmethod
    def build(
        cls,
        *,
        slot_mapping: np.ndarray,
        query_start_loc: np.ndarray,
        seq_lens: np.ndarray,
        block_tables: np.ndarray,
        device: torch.device | str,
    ) -> "AttentionMetadata":
        """Check the host arrays, derive the split sizes, copy everything to ``device``."""
        qsl = np.asarray(query_start_loc, dtype=np.int64)  # [B+1]
        sl = np.asarray(seq_lens, dtype=np.int64)  # [B]
        bt = np.asarray(block_tables, dtype=np.int64)  # [B, M]
        slots = np.asarray(slot_mapping, dtype=np.int64).reshape(-1)  # [T]
        if bt.size == 0:
            bt = np.zeros((sl.shape[0], 0), dtype=np.int64)  # [B, 0]
        _check_shapes(slots, qsl, sl, bt)
        qlens = qsl[1:] - qsl[:-1]  # [B]
        num_decodes = _count_leading_decodes(qlens)
        dec, pre = slice(0, num_decodes), slice(num_decodes, None)

        def dev(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a)).to(device=device, dtype=dtype)

        return cls(
            slot_mapping=dev(slots, torch.int64),
            query_start_loc=dev(qsl, torch.int32),
            seq_lens=dev(sl, torch.int32),
            block_tables=dev(np.maximum(bt, 0), torch.int32),
            max_query_len=_max(qlens),
            max_seq_len=_max(sl),
            num_tokens=int(qsl[-1]),
            query_lens=dev(qlens, torch.int32),
            num_decodes=num_decodes,
            decode_max_seq_len=_max(sl[dec]),
            prefill_max_seq_len=_max(sl[pre]),
            prefill_max_query_len=_max(qlens[pre]),
            query_start_loc_cpu=qsl,
            seq_lens_cpu=sl,
        )


def _max(a: np.ndarray) -> int:
    return int(a.max()) if a.size else 0


def _count_leading_decodes(query_lens: np.ndarray) -> int:
    not_decode = np.flatnonzero(query_lens != 1)
    return int(not_decode[0]) if not_decode.size else int(query_lens.size)


def _check_shapes(slots: np.ndarray, qsl: np.ndarray, sl: np.ndarray, bt: np.ndarray) -> None:
    if qsl.ndim != 1 or sl.ndim != 1 or qsl.shape[0] != sl.shape[0] + 1:
        raise ValueError(f"query_start_loc {qsl.shape} must be seq_lens {sl.shape} + 1 long")
    if bt.ndim != 2 or bt.shape[0] != sl.shape[0]:
        raise ValueError(f"block_tables {bt.shape} must be [B={sl.shape[0]}, M]")
    if qsl.size and (qsl[0] != 0 or np.any(np.diff(qsl) < 0)):
        raise ValueError("query_start_loc must start at 0 and never decrease")
    num_tokens = int(qsl[-1]) if qsl.size else 0
    if slots.ndim != 1 or slots.shape[0] < num_tokens:
        raise ValueError(f"slot_mapping {slots.shape} shorter than the {num_tokens} tokens")
    if np.any(sl < np.diff(qsl)):
        raise ValueError("a sequence's seq_len is shorter than its query")

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
``decode_query_len`` leaves room for speculative verification: decode sequences of
``1 + drafts`` tokens each, which only a backend declaring ``multi_token_decode``
(``attention/interface.py``) may be given; today every builder leaves it at 1.

KV cache groups (``core/kv_cache_manager.py``): each group has its own ``slot_mapping``
and ``block_tables``; everything else is shared. The object the model receives is group
0's (full attention, or the only group); ``view(sliding_window)`` returns the one of the
group with that window (``layers/attention.py`` calls it with the layer's window; MLA
layers use ``view(None)``). With a single group every window maps to it. Block-table
entries of freed out-of-window blocks (-1) are clamped to block 0: their positions are
masked by the window, so the backend never uses what it reads there.

Linear-attention layers read ``state_slots [B]`` (each sequence's slot in its
``StateSpec`` tensors) and ``has_initial_state [B]`` (the sequence had computed tokens
before this step). The worker zeroes the slot of every sequence with
``has_initial_state == False`` before the forward, so a layer may read its slot either way.

``RopeInputs`` is a layer's rotary embedding at the step's positions, built by the layer
for a backend that rotates q and k in the kernel that writes the K/V cache.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Sequence, Tuple

import numpy as np
import torch

from cvllm.kernels.transfer import to_device

PAD_SLOT_ID = -1
"""slot_mapping value of a padding token: nothing is written for it."""


@dataclass(frozen=True)
class RopeInputs:
    """A layer's rotary embedding, handed to a backend that applies it together with the
    K/V cache write (``backends/triton_backend.py``). Built per layer call by
    ``layers/rotary.RotaryEmbedding.rope_inputs``; the backend rotates q and k in place,
    as ``RotaryEmbedding.forward`` would have."""

    positions: torch.Tensor  # [T] int: every token's position, padding rows included
    cos_sin_cache: torch.Tensor  # [max_pos, rotary_dim] float32: cos half | sin half
    head_size: int
    is_neox_style: bool


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
    """Leading sequences with exactly ``decode_query_len`` query tokens (one: their tokens
    are 0..num_decodes-1)."""
    decode_max_seq_len: int
    """Longest context among the leading decode sequences (0 when none)."""
    prefill_max_seq_len: int
    """Longest context among the other sequences (0 when none)."""
    prefill_max_query_len: int
    """Most query tokens of one of the other sequences (0 when none)."""
    query_start_loc_cpu: np.ndarray  # [B+1] int64 host copy, for host-side planning
    seq_lens_cpu: np.ndarray  # [B] int64 host copy
    has_initial_state: Optional[torch.Tensor] = None  # [B] bool: computed tokens before this step
    state_slots: Optional[torch.Tensor] = None  # [B] int64: linear-attention state slot, -1 none
    sliding_window: Optional[int] = None
    """Window of the KV cache group whose slot_mapping / block_tables these are."""
    decode_query_len: int = 1
    """Query tokens of each decode sequence: 1, or ``1 + drafts`` for speculative
    verification (``build(decode_query_len=)``; a backend with ``multi_token_decode``)."""
    groups: Dict[Optional[int], "AttentionMetadata"] = field(default_factory=dict, repr=False)
    """Every group's view by window (this one included); shared by all views."""
    host_cache: Dict[Any, Any] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    """Per-step values a CPU backend derives once and reuses in every layer (index and
    mask tensors, cos/sin rows), keyed by their maker. Each view starts with its own
    (``init=False``: ``dataclasses.replace`` leaves it fresh), as group views differ in
    block tables; it dies with the step's metadata."""

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    def view(self, sliding_window: Optional[int]) -> "AttentionMetadata":
        """The metadata of the KV cache group of layers with ``sliding_window``."""
        if len(self.groups) <= 1:
            return self
        key = int(sliding_window) if sliding_window else None
        view = self.groups.get(key)
        if view is None:
            raise KeyError(
                f"no KV cache group for sliding_window={key}; "
                f"groups: {sorted(self.groups, key=str)}"
            )
        return view

    @classmethod
    def build(cls, *, slot_mapping: np.ndarray, query_start_loc: np.ndarray,
              seq_lens: np.ndarray, block_tables: np.ndarray, device: torch.device | str,
              sliding_window: Optional[int] = None,
              extra_groups: Sequence[Tuple[Optional[int], np.ndarray, np.ndarray]] = (),
              state_slots: Optional[np.ndarray] = None, decode_query_len: int = 1,
              ) -> "AttentionMetadata":
        """Check the host arrays, derive the split sizes, copy everything to ``device``.

        ``slot_mapping`` / ``block_tables`` are group 0's (window ``sliding_window``);
        ``extra_groups`` are ``(window, slot_mapping [T], block_tables [B, M])`` of the
        others; ``state_slots [B]`` defaults to -1 (no state layers); the leading
        sequences of ``decode_query_len`` tokens each are the decodes."""
        qsl = np.asarray(query_start_loc, dtype=np.int64)  # [B+1]
        sl = np.asarray(seq_lens, dtype=np.int64)  # [B]
        slots, bt = _checked_group(slot_mapping, block_tables, qsl, sl)  # [T], [B, M]
        qlens = qsl[1:] - qsl[:-1]  # [B]
        num_decodes = _count_leading_decodes(qlens, decode_query_len)
        meta = cls(
            slot_mapping=to_device(slots, device, torch.int64),
            query_start_loc=to_device(qsl, device, torch.int32),
            seq_lens=to_device(sl, device, torch.int32),
            block_tables=to_device(np.maximum(bt, 0), device, torch.int32),
            max_query_len=_max(qlens),
            max_seq_len=_max(sl),
            num_tokens=int(qsl[-1]),
            query_lens=to_device(qlens, device, torch.int32),
            num_decodes=num_decodes,
            decode_max_seq_len=_max(sl[:num_decodes]),
            prefill_max_seq_len=_max(sl[num_decodes:]),
            prefill_max_query_len=_max(qlens[num_decodes:]),
            query_start_loc_cpu=qsl,
            seq_lens_cpu=sl,
            has_initial_state=to_device(sl - qlens > 0, device, torch.bool),
            state_slots=to_device(_state_slots(state_slots, sl.shape[0]), device, torch.int64),
            sliding_window=int(sliding_window) if sliding_window else None,
            decode_query_len=decode_query_len,
        )
        meta.groups[meta.sliding_window] = meta
        for window, g_slots, g_tables in extra_groups:
            meta._add_group(window, g_slots, g_tables, device)
        return meta

    def _add_group(self, window: Optional[int], slots, tables, device) -> None:
        key = int(window) if window else None
        if key in self.groups:
            raise ValueError(f"two KV cache groups with sliding_window={key}")
        slots, bt = _checked_group(slots, tables, self.query_start_loc_cpu,
                                  self.seq_lens_cpu)  # [T], [B, M]
        self.groups[key] = dataclasses.replace(
            self, slot_mapping=to_device(slots, device, torch.int64),
            block_tables=to_device(np.maximum(bt, 0), device, torch.int32), sliding_window=key,
        )


def _max(a: np.ndarray) -> int:
    return int(a.max()) if a.size else 0


def _state_slots(state_slots: Optional[np.ndarray], B: int) -> np.ndarray:
    """Each sequence's linear-attention state slot ``[B]``; -1 (none) by default."""
    slots = np.full(B, -1, np.int64) if state_slots is None else np.asarray(state_slots, np.int64)
    if slots.shape != (B,):
        raise ValueError(f"state_slots {slots.shape} must be [B={B}]")
    return slots


def _count_leading_decodes(query_lens: np.ndarray, decode_query_len: int) -> int:
    if decode_query_len < 1:
        raise ValueError(f"decode_query_len must be >= 1, got {decode_query_len}")
    not_decode = np.flatnonzero(query_lens != decode_query_len)
    return int(not_decode[0]) if not_decode.size else int(query_lens.size)


def _checked_group(slot_mapping: np.ndarray, block_tables: np.ndarray, qsl: np.ndarray,
                  sl: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """One KV group's ``slot_mapping [T]`` and ``block_tables [B, M]`` as int64 (an empty
    table as ``[B, 0]``), checked against ``query_start_loc`` ``qsl`` and ``seq_lens`` ``sl``."""
    slots = np.asarray(slot_mapping, dtype=np.int64).reshape(-1)  # [T]
    bt = np.asarray(block_tables, dtype=np.int64)  # [B, M]
    if bt.size == 0:
        bt = np.zeros((sl.shape[0], 0), dtype=np.int64)  # [B, 0]
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
    return slots, bt

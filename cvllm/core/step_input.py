"""The wire contract between ranks: one scheduled step as flat little-endian arrays.

``build_step_input`` runs on rank 0 right after ``Scheduler.schedule()`` and builds a
``StepInput`` from the ``SchedulerOutput``. ``distributed/`` broadcasts ``pack()``'s bytes;
every other rank ``unpack()``s them, checks ``step_id`` and hands the ``StepInput`` to its
``ModelRunner``, which owns it for that one step (rank 0 keeps its own copy). Only rank 0
samples, but all ranks receive the sampling rows: they are small, and a rank that takes
over sampling later needs no new wire format.

The wire format (header, array codec, control messages) is ``core/wire_format.py``;
every length is bounded before anything is allocated (DESIGN rule 12); a malformed
buffer raises ``StepInputError``. ``build_step_input`` is ``core/step_builder.py``.

Shapes: T tokens in the step, B sequences, S sampling rows (sequences whose logits are
sampled this step), M max blocks of any sequence in the step, G KV cache groups (>= 1).

KV cache groups (``core/kv_cache_manager.py``): ``slot_mapping`` / ``block_tables`` are
group 0's; groups 1.. are in ``group_slot_mapping[g-1]`` / ``group_block_tables[g-1]``;
``kv_group_windows[g]`` is group g's sliding window (0 = full attention). In a sliding
group, entries of blocks freed because they lie wholly before the first query's window
are ``PLACEHOLDER_BLOCK`` (-1). ``state_slots[b]`` is sequence b's linear-attention state
slot (-1 when the model has no state layers).

Overlapped loop: ``prev_rows[t]`` >= 0 says token t's id is not known on the host yet
(``input_ids[t]`` holds -1): it is the id sampled at that row of the previous step, which
the runner patches in on the device (``core/sequence.py`` placeholders).

Block copies: ``block_copies[c] = (src, dst)`` block ids of KV group 0 whose K/V every
layer of that group copies, src to dst, before this step's forward (a lone CPU sequence's
prefix hit, taken as copies so that its blocks are consecutive: ``Scheduler``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional, Sequence, Tuple, Union

import numpy as np

from cvllm.core.block_manager import PLACEHOLDER_BLOCK
from cvllm.core.wire_format import (
    DEFAULT_MAX_BODY_BYTES, F32, I32, I64, STEP_FIELDS, ControlMessage, MessageHeader,
    MessageKind, StepInputError, checked_body, decode_arrays, encode_arrays, pack_message,
)

MAX_KV_GROUPS = 64
SAMPLING_FIELDS = (
    "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "has_seed", "seeds", "output_index",
)
"""The per-row values ``build_step_input`` fills from each sequence's SamplingParams."""


def unpack_message(
    buf, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
) -> Union["StepInput", ControlMessage]:
    """Dispatch on the header kind: a STEP gives a StepInput, anything else a ControlMessage."""
    if MessageHeader.unpack(buf, max_body_bytes).kind == MessageKind.STEP:
        return StepInput.unpack(buf, max_body_bytes)
    return ControlMessage.unpack(buf, max_body_bytes)


@dataclass(eq=False)
class StepInput:
    step_id: int
    input_ids: np.ndarray  # [T] int32
    positions: np.ndarray  # [T] int32
    slot_mapping: np.ndarray  # [T] int64, block_id * block_size + offset
    query_start_loc: np.ndarray  # [B+1] int32
    seq_lens: np.ndarray  # [B] int32, context length after this step
    block_tables: np.ndarray  # [B, M] int32, 0-padded past each sequence's blocks
    logits_indices: np.ndarray  # [S] int32, index in T of each sampling row's last token
    sample_rows: np.ndarray  # [S] int32, which of the B sequences
    temperature: np.ndarray  # [S] float32
    top_p: np.ndarray  # [S] float32
    top_k: np.ndarray  # [S] int32, -1 = off
    min_p: np.ndarray  # [S] float32
    presence_penalty: np.ndarray  # [S] float32
    frequency_penalty: np.ndarray  # [S] float32
    repetition_penalty: np.ndarray  # [S] float32
    has_seed: np.ndarray  # [S] int32, 0/1: whether seeds[i] is set
    seeds: np.ndarray  # [S] int64, any int64 is a valid seed
    output_index: np.ndarray  # [S] int32, tokens the sequence generated before this step
    kv_group_windows: np.ndarray  # [G] int32, sliding window of each KV group, 0 = full
    group_slot_mapping: np.ndarray  # [G-1, T] int64, slot_mapping of groups 1..G-1
    group_block_tables: np.ndarray  # [G-1, B, M'] int32, block_tables of groups 1..G-1
    state_slots: np.ndarray  # [B] int32, linear-attention state slot, -1 = none
    prev_rows: np.ndarray  # [T] int32, previous step's sampling row giving the id, -1 = none
    block_copies: np.ndarray = field(
        default_factory=lambda: np.zeros((0, 2), I32))  # [C, 2] int32 (src, dst), group 0

    # ----- shape helpers ---------------------------------------------------------------

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_samples(self) -> int:
        return int(self.logits_indices.shape[0])

    @property
    def query_lens(self) -> np.ndarray:
        return np.diff(self.query_start_loc)  # [B]

    @property
    def max_query_len(self) -> int:
        return int(self.query_lens.max()) if self.num_seqs else 0

    @property
    def max_seq_len(self) -> int:
        return int(self.seq_lens.max()) if self.num_seqs else 0

    @property
    def num_kv_groups(self) -> int:
        return int(self.kv_group_windows.shape[0])

    def kv_group(self, g: int) -> Tuple[Optional[int], np.ndarray, np.ndarray]:
        """Group g's ``(sliding_window or None, slot_mapping [T], block_tables [B, M])``."""
        if not 0 <= g < self.num_kv_groups:
            raise IndexError(f"KV group {g} of {self.num_kv_groups}")
        window = int(self.kv_group_windows[g]) or None
        if g == 0:
            return window, self.slot_mapping, self.block_tables
        return window, self.group_slot_mapping[g - 1], self.group_block_tables[g - 1]

    def arrays(self) -> Dict[str, np.ndarray]:
        return {name: getattr(self, name) for name, _, _ in STEP_FIELDS.values()}

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, StepInput) or self.step_id != other.step_id:
            return False
        mine, theirs = self.arrays(), other.arrays()
        return all(
            mine[k].dtype == theirs[k].dtype and mine[k].shape == theirs[k].shape
            and np.array_equal(mine[k], theirs[k]) for k in mine
        )

    @classmethod
    def empty(
        cls, step_id: int = 0, group_windows: Sequence[Optional[int]] = (None,)
    ) -> "StepInput":
        """A step with no sequences (B = T = S = 0)."""
        arrays = {name: np.zeros(0, dt) for name, dt, _ in STEP_FIELDS.values()}
        arrays["query_start_loc"] = np.zeros(1, I32)
        arrays["block_tables"] = np.zeros((0, 0), I32)
        arrays["kv_group_windows"] = windows_array(group_windows)
        G = len(group_windows)
        arrays["group_slot_mapping"] = np.zeros((G - 1, 0), I64)
        arrays["group_block_tables"] = np.zeros((G - 1, 0, 0), I32)
        arrays["block_copies"] = np.zeros((0, 2), I32)
        return cls(step_id=step_id, **arrays)

    # ----- validation ------------------------------------------------------------------

    def validate(
        self, block_size: Optional[int] = None,
        num_blocks: Union[None, int, Sequence[int]] = None,
    ) -> None:
        """Check dtypes, shapes and the invariants the runner relies on.

        With ``block_size`` (and ``num_blocks``: one count for every group, or one per
        group) it also checks that every slot lies in the block its sequence's block
        table names, inside the cache, and that placeholders sit only before the window.
        """
        self._validate_layout()
        self._validate_batch()
        self._validate_sampling()
        if block_size is None:
            self.validate_copies(None)
        else:
            counts = num_blocks if isinstance(num_blocks, (list, tuple)) else \
                [num_blocks] * self.num_kv_groups
            if len(counts) != self.num_kv_groups:
                raise StepInputError(
                    f"{len(counts)} block counts for {self.num_kv_groups} KV groups"
                )
            for g in range(self.num_kv_groups):
                self._validate_slots(g, block_size, counts[g])
            self.validate_copies(counts[0])

    def _validate_layout(self) -> None:
        if not 0 <= self.step_id < 2**64:
            raise StepInputError(f"step_id {self.step_id} does not fit in u64")
        for name, dtype, dims in STEP_FIELDS.values():
            arr = getattr(self, name)
            if not isinstance(arr, np.ndarray) or arr.dtype != dtype:
                got = getattr(arr, "dtype", type(arr).__name__)
                raise StepInputError(f"{name} must be a {dtype} array, got {got}")
            if arr.ndim != len(dims):
                raise StepInputError(f"{name} has {arr.ndim} dims, expected {len(dims)}")
        T, B, S, G = self.num_tokens, self.num_seqs, self.num_samples, self.num_kv_groups
        if not 1 <= G <= MAX_KV_GROUPS:
            raise StepInputError(
                f"kv_group_windows names {G} KV groups, expected 1..{MAX_KV_GROUPS}"
            )
        for name, dtype, dims in STEP_FIELDS.values():
            arr = getattr(self, name)
            sizes = {"T": T, "B": B, "S": S, "B+1": B + 1, "G": G, "G-1": G - 1,
                     "M": arr.shape[-1], "C": arr.shape[0], "2": 2}
            want = tuple(sizes[d] for d in dims)
            if arr.shape != want:
                raise StepInputError(
                    f"{name} has shape {arr.shape}, expected {want} (T={T}, B={B}, S={S}, G={G})"
                )

    def _validate_batch(self) -> None:
        qsl, T = self.query_start_loc, self.num_tokens
        if qsl[0] != 0 or qsl[-1] != T:
            raise StepInputError(
                f"query_start_loc must run from 0 to T={T}, got {qsl[0]}..{qsl[-1]}"
            )
        query_lens = self.query_lens
        if (query_lens < 1).any():
            raise StepInputError(
                "query_start_loc must be strictly increasing (every sequence computes >= 1 token)"
            )
        if (self.seq_lens < query_lens).any():
            raise StepInputError("seq_lens must be >= the query length of each sequence")
        # Each sequence's new tokens sit at positions [seq_len - query_len, seq_len).
        starts = np.repeat(self.seq_lens - query_lens, query_lens)
        offsets = np.arange(T) - np.repeat(qsl[:-1], query_lens)
        if not np.array_equal(self.positions, starts + offsets):
            raise StepInputError("positions do not match query_start_loc and seq_lens")
        self._validate_groups()
        patched = self.prev_rows >= 0
        if (self.prev_rows < -1).any() or not np.array_equal(patched, self.input_ids == -1):
            raise StepInputError("input_ids must be -1 exactly where prev_rows names a row")
        if (self.input_ids < -1).any():
            raise StepInputError("input_ids must be non-negative token ids")
        live = self.state_slots[self.state_slots >= 0]
        if (self.state_slots < -1).any() or np.unique(live).size != live.size:
            raise StepInputError("state_slots must be distinct slot ids, or -1 for none")

    def validate_copies(self, num_blocks: Optional[int]) -> None:
        """``block_copies``: ids in the cache (of ``num_blocks`` when given), each dst
        distinct and not itself a src (also the runner's check on rank 0)."""
        if not self.block_copies.size:
            return  # the usual step: no numpy calls on the per-step path
        src, dst = self.block_copies[:, 0], self.block_copies[:, 1]
        if (self.block_copies < 0).any():
            raise StepInputError(f"step {self.step_id} copies a block outside the cache: "
                                 "block ids must be non-negative")
        if num_blocks is not None and (self.block_copies >= num_blocks).any():
            raise StepInputError(f"step {self.step_id} copies a block outside the cache "
                                 f"(num_blocks={num_blocks})")
        if np.unique(dst).size != dst.size or np.isin(dst, src).any():
            raise StepInputError("block_copies must copy into distinct blocks that are "
                                 "not themselves copied")

    def _validate_groups(self) -> None:
        if (self.kv_group_windows < 0).any():
            raise StepInputError("kv_group_windows must be >= 0 (0: full attention)")
        if np.unique(self.kv_group_windows).size != self.num_kv_groups:
            raise StepInputError("two KV groups have the same window")
        for g in range(self.num_kv_groups):
            window, slots, tables = self.kv_group(g)
            if (slots < 0).any():
                raise StepInputError("slot_mapping must be non-negative")
            lowest = PLACEHOLDER_BLOCK if window else 0
            if (tables < lowest).any():
                raise StepInputError(
                    "block_tables must be non-negative" if window is None
                    else f"block_tables of window {window} must be >= {PLACEHOLDER_BLOCK}"
                )

    def _validate_slots(self, g: int, block_size: int, num_blocks: Optional[int]) -> None:
        window, slot_mapping, tables = self.kv_group(g)
        M = tables.shape[1]
        if self.num_seqs and -(-self.max_seq_len // block_size) > M:
            raise StepInputError(
                f"block_tables of KV group {g} has {M} columns, too few for seq_len "
                f"{self.max_seq_len}"
            )
        if num_blocks is not None and (tables >= num_blocks).any():
            raise StepInputError(f"block_tables names a block >= num_blocks={num_blocks}")
        if window is not None:
            # A placeholder may only stand for a block wholly before the first query's window.
            first_live = np.maximum(self.seq_lens - self.query_lens - window + 1, 0) // block_size
            cols = np.arange(M)[None, :]  # [1, M]
            if ((tables == PLACEHOLDER_BLOCK) & (cols >= first_live[:, None])).any():
                raise StepInputError(f"a placeholder block lies inside window {window}")
        seq_idx = np.repeat(np.arange(self.num_seqs), self.query_lens)  # [T]
        pos = self.positions.astype(np.int64)
        blocks = tables[seq_idx, pos // block_size].astype(np.int64)
        if not np.array_equal(slot_mapping, blocks * block_size + pos % block_size):
            raise StepInputError("slot_mapping does not match block_tables and positions")

    def _validate_sampling(self) -> None:
        rows, B = self.sample_rows, self.num_seqs
        if ((rows < 0) | (rows >= B)).any() or (np.diff(rows) <= 0).any():
            raise StepInputError(f"sample_rows must be strictly increasing indices in [0, {B})")
        if not np.array_equal(self.logits_indices, self.query_start_loc[rows + 1] - 1):
            raise StepInputError("logits_indices must point at the last token of each sampled row")
        floats = [getattr(self, n) for n in SAMPLING_FIELDS if getattr(self, n).dtype == F32]
        if not all(np.isfinite(a).all() for a in floats):
            raise StepInputError("sampling values must be finite")
        checks = [
            ("temperature", (self.temperature >= 0).all()),
            ("top_p", ((self.top_p > 0) & (self.top_p <= 1)).all()),
            ("top_k", ((self.top_k == -1) | (self.top_k >= 1)).all()),
            ("min_p", ((self.min_p >= 0) & (self.min_p <= 1)).all()),
            ("repetition_penalty", (self.repetition_penalty > 0).all()),
            ("has_seed", np.isin(self.has_seed, (0, 1)).all()),
            ("output_index", (self.output_index >= 0).all()),
        ]
        for name, ok in checks:
            if not ok:
                raise StepInputError(f"{name} has an out-of-range value")

    # ----- wire ------------------------------------------------------------------------

    def pack(self) -> bytes:
        self.validate()
        return pack_message(MessageKind.STEP, self.step_id, encode_arrays(self))

    @classmethod
    def unpack(cls, buf, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> "StepInput":
        header, body = checked_body(buf, max_body_bytes)
        if header.kind != MessageKind.STEP:
            raise StepInputError(f"expected a STEP message, got {header.kind.name}")
        arrays = decode_arrays(body)
        step = cls(step_id=header.step_id, **arrays)
        step.validate()
        return step


def windows_array(windows: Sequence[Optional[int]]) -> np.ndarray:
    """``kv_group_windows``: each group's sliding window, 0 for full attention (None)."""
    return np.asarray([int(w or 0) for w in windows], I32)  # [G]

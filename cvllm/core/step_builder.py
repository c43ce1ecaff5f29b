"""``build_step_input``: one ``SchedulerOutput`` flattened into the ``StepInput`` every
rank runs (``core/step_input.py``, the wire contract).

Called on rank 0 only, by the engine right after ``Scheduler.schedule()``; it reads the
scheduled sequences (tokens, blocks of each KV cache group, state slots, placeholders,
sampling parameters) and never changes them. Pure Python + numpy.
"""

from __future__ import annotations

import itertools
from typing import Dict, Optional, Sequence, Tuple

import numpy as np

from cvllm.core.scheduler_output import SchedulerOutput
from cvllm.core.step_input import StepInput, windows_array
from cvllm.core.wire_format import F32, I32, I64


def build_step_input(
    out: SchedulerOutput, block_size: int, group_windows: Sequence[Optional[int]] = (None,)
) -> StepInput:
    """Flatten a SchedulerOutput into the arrays every rank runs (rank 0 only).
    ``group_windows``: the sliding window of each KV cache group (None = full), as in
    ``KVCacheLayout.windows``."""
    entries = out.scheduled
    B = len(entries)
    if B == 0:
        return StepInput.empty(out.step_id, group_windows)
    query_lens = np.fromiter((e.num_new_tokens for e in entries), np.int64, B)  # [B]
    computed = np.fromiter((e.start for e in entries), np.int64, B)  # [B]
    seq_lens = computed + query_lens  # [B]
    query_start_loc = np.zeros(B + 1, np.int64)  # [B+1]
    np.cumsum(query_lens, out=query_start_loc[1:])
    T = int(query_start_loc[-1])

    input_ids = _input_ids(entries, T)  # [T]
    seq_idx = np.repeat(np.arange(B), query_lens)  # [T]
    offsets = np.arange(T) - np.repeat(query_start_loc[:-1], query_lens)  # [T] index in its query
    positions = np.repeat(computed, query_lens) + offsets  # [T]
    groups = [_group_arrays(entries, g, seq_lens, seq_idx, positions, block_size)
              for g in range(len(group_windows))]
    group_slot_mapping, group_block_tables = _later_groups(groups, B, T)

    rows = [i for i, e in enumerate(entries) if e.samples]
    rows_arr = np.asarray(rows, I32)  # [S]
    return StepInput(
        step_id=out.step_id,
        input_ids=input_ids,
        positions=positions.astype(I32),
        slot_mapping=groups[0][0],
        query_start_loc=query_start_loc.astype(I32),
        seq_lens=seq_lens.astype(I32),
        block_tables=groups[0][1],
        logits_indices=(query_start_loc[rows_arr + 1] - 1).astype(I32),
        sample_rows=rows_arr,
        kv_group_windows=windows_array(group_windows),
        group_slot_mapping=group_slot_mapping,
        group_block_tables=group_block_tables,
        state_slots=np.fromiter((e.seq.state_slot for e in entries), I32, B),
        prev_rows=_prev_rows(entries, query_start_loc, T),
        block_copies=np.asarray(out.block_copies, I32).reshape(-1, 2),
        **_sampling_arrays([entries[i] for i in rows]),
    )


def _group_arrays(entries, g: int, seq_lens: np.ndarray, seq_idx: np.ndarray,
                  positions: np.ndarray, block_size: int) -> Tuple[np.ndarray, np.ndarray]:
    """KV group g's ``(slot_mapping [T] int64, block_tables [B, M] int32)``."""
    lists = [e.seq.group_block_ids(g) for e in entries]
    block_tables = np.zeros((len(entries), max(len(b) for b in lists)), I32)  # [B, M]
    for i, (e, ids) in enumerate(zip(entries, lists)):
        if len(ids) * block_size < seq_lens[i]:
            raise ValueError(
                f"{e.seq!r} has too few blocks in KV group {g} for {seq_lens[i]} tokens"
            )
        block_tables[i, :len(ids)] = ids
    blocks = block_tables[seq_idx, positions // block_size].astype(I64)  # [T]
    if (blocks < 0).any():
        raise ValueError(f"a token of this step falls in a freed block of KV group {g}")
    return blocks * block_size + positions % block_size, block_tables


def _input_ids(entries, T: int) -> np.ndarray:
    """[T] int32: each sequence's tokens of this step, in order."""
    return np.fromiter(
        itertools.chain.from_iterable(
            e.seq.token_ids[e.start:e.start + e.num_new_tokens] for e in entries
        ),
        I32,
        T,
    )


def _later_groups(groups, B: int, T: int) -> Tuple[np.ndarray, np.ndarray]:
    """KV groups 1.. stacked: ``(group_slot_mapping [G-1, T] int64, group_block_tables
    [G-1, B, M'] int32)``, each group's tables 0-padded to the widest."""
    M2 = max([t.shape[1] for _, t in groups[1:]], default=0)
    group_block_tables = np.zeros((len(groups) - 1, B, M2), I32)  # [G-1, B, M']
    for g, (_, t) in enumerate(groups[1:]):
        group_block_tables[g, :, :t.shape[1]] = t
    group_slot_mapping = np.stack([s for s, _ in groups[1:]]) if len(groups) > 1 \
        else np.zeros((0, T), I64)
    return group_slot_mapping, group_block_tables


def _prev_rows(entries, query_start_loc: np.ndarray, T: int) -> np.ndarray:
    """[T] int32: a placeholder is only ever the single new token of a decode."""
    prev = np.full(T, -1, I32)
    for i, e in enumerate(entries):
        if e.prev_row >= 0:
            if e.num_new_tokens != 1:
                raise ValueError(f"{e.seq!r}: a placeholder input in a {e.num_new_tokens}-token step")
            prev[query_start_loc[i]] = e.prev_row
    return prev


def _sampling_arrays(entries) -> Dict[str, np.ndarray]:
    """Per-sampling-row values from each sequence's SamplingParams."""
    params = [e.seq.params for e in entries]
    return {
        "temperature": np.asarray([p.temperature for p in params], F32),
        "top_p": np.asarray([p.top_p for p in params], F32),
        "top_k": np.asarray([p.top_k for p in params], I32),
        "min_p": np.asarray([p.min_p for p in params], F32),
        "presence_penalty": np.asarray([p.presence_penalty for p in params], F32),
        "frequency_penalty": np.asarray([p.frequency_penalty for p in params], F32),
        "repetition_penalty": np.asarray([p.repetition_penalty for p in params], F32),
        "has_seed": np.asarray([p.seed is not None for p in params], I32),
        "seeds": np.asarray([p.seed or 0 for p in params], I64),
        # the sampled token lands right after the step's last input token
        "output_index": np.asarray([e.start + e.num_new_tokens - e.seq.num_prompt_tokens
                                    for e in entries], I32),
    }

"""One generation stream: its tokens, how many of them have KV in the cache, its blocks.

Built by ``engine/`` on rank 0 when a request is added (one ``Sequence`` per completion;
``n > 1`` is fanned out before it reaches here). Owned by the ``Scheduler`` while it is
unfinished, then handed back to the engine. Lives on rank 0 only: other ranks see only
the flat ``StepInput`` built from it.

There is no prefill phase and no decode phase. Each step a sequence is given
``num_new_tokens`` so that ``num_computed_tokens`` catches up with ``len(token_ids)``;
chunked prefill, prefix-cache hits and recompute after preemption are just different
numbers.

Placeholders: when a step that samples a sequence is scheduled, the scheduler appends
``PLACEHOLDER_TOKEN`` for the token it will sample, so the next step can be scheduled
(and run on the GPU, which patches the real id in) before the host knows that token --
the overlapped engine loop. ``update()`` writes the real id over it.
``num_pending_tokens`` counts the placeholders at the tail; ``confirmed_*`` views leave
them out (what the detokenizer, usage and penalties see).

Prefix caching (``core/prefix_cache.py``): ``block_hashes`` holds the chained content key
of every full block of confirmed tokens, extended as tokens become known; the block
managers register and look up blocks by these keys.
"""

from __future__ import annotations

import enum
from typing import List, Optional, Sequence as Seq, Tuple, Union

from cvllm.core.prefix_cache import BlockHash, hash_block_tokens
from cvllm.sampling_params import SamplingParams

PLACEHOLDER_TOKEN = -1
"""The id of a token that is being sampled by a step in flight."""


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()

    def is_finished(self) -> bool:
        """Works as ``status.is_finished()`` and as vLLM's ``SequenceStatus.is_finished(s)``."""
        return self in _FINISHED

    @property
    def finish_reason(self) -> Optional[str]:
        """The OpenAI ``finish_reason`` of a finished status; None while unfinished."""
        return _FINISH_REASONS.get(self)

    @classmethod
    def from_finish_reason(cls, reason: str) -> "SequenceStatus":
        for status, name in _FINISH_REASONS.items():
            if name == reason:
                return status
        raise ValueError(f"finish reason must be one of 'stop', 'length', 'abort', got {reason!r}")


_FINISHED = frozenset(
    {
        SequenceStatus.FINISHED_STOPPED,
        SequenceStatus.FINISHED_LENGTH,
        SequenceStatus.FINISHED_ABORTED,
    }
)
_FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
}


class Sequence:
    """Token ids (prompt then outputs) plus the scheduling state of one completion."""

    def __init__(
        self,
        seq_id: int,
        request_id: str,
        prompt_token_ids: Seq[int],
        params: SamplingParams,
        eos_token_ids: Seq[int] = (),
        arrival_time: float = 0.0,
    ) -> None:
        if len(prompt_token_ids) == 0:
            raise ValueError(f"sequence {seq_id} of request {request_id!r} has an empty prompt")
        self.seq_id = seq_id
        self.request_id = request_id
        self.params = params
        self.eos_token_ids: List[int] = list(eos_token_ids)
        self.arrival_time = arrival_time
        self.first_scheduled_time: Optional[float] = None
        """``time.monotonic()`` when the scheduler first admitted it (queue time)."""
        self.token_ids: List[int] = [int(t) for t in prompt_token_ids]
        self.num_prompt_tokens = len(self.token_ids)
        self.num_computed_tokens = 0
        """Tokens whose KV is in the cache (reset to 0 by preemption)."""
        self.status = SequenceStatus.WAITING
        self.num_preemptions = 0
        self._init_cache_state()
        self._init_output_state(params)

    def _init_cache_state(self) -> None:
        """Where its K/V lives: blocks, state slot, prefix-cache keys."""
        self.block_ids_by_group: List[List[int]] = [[]]
        """Per KV cache group (see ``core/kv_cache_manager.py``), the block ids in position
        order, covering at least ``num_computed_tokens`` tokens. In a sliding-window group
        the blocks wholly before the window are freed and their entries become
        ``PLACEHOLDER_BLOCK`` (-1), so index ``i`` always holds positions ``i*bs ..``."""
        self.state_slot = -1
        """Linear-attention state slot (``StateSpec`` layers) while running; -1 when none."""
        self.block_hashes: List[BlockHash] = []
        """Prefix-cache key of each full block of confirmed tokens (``update_block_hashes``)."""
        self.extra_hash_keys: Tuple = ()
        """Keys besides the tokens that change every block's K/V (a LoRA adapter's name,
        a cache salt); features that change only some blocks (images) extend
        ``_block_extra_keys`` instead."""
        self.num_cached_tokens = 0
        """Prompt tokens whose K/V came from the prefix cache at the first admission
        (``usage.prompt_tokens_details.cached_tokens``)."""

    def _init_output_state(self, params: SamplingParams) -> None:
        """How its output ends, and the placeholders of the steps in flight."""
        self.finish_reason: Optional[str] = None
        """'stop', 'length' or 'abort' once finished."""
        self.stop_reason: Optional[Union[int, str]] = None
        """The stop token id or stop string that ended the sequence (None for EOS)."""
        self.max_tokens: Optional[int] = params.max_tokens
        """Cap on output tokens; the engine may lower it (e.g. to fit max_model_len)."""
        self.num_pending_tokens = 0
        """Placeholders at the tail of ``token_ids`` (steps in flight that sample it)."""
        self.last_sample_row = -1
        """The sampling row of this sequence in the newest step that samples it."""

    @property
    def block_ids(self) -> List[int]:
        """Block ids of KV cache group 0 (the only group of most models)."""
        return self.block_ids_by_group[0]

    @block_ids.setter
    def block_ids(self, ids: List[int]) -> None:
        self.block_ids_by_group[0] = ids

    def group_block_ids(self, group: int) -> List[int]:
        """The (mutable) block id list of KV cache group ``group``."""
        while len(self.block_ids_by_group) <= group:
            self.block_ids_by_group.append([])
        return self.block_ids_by_group[group]

    @property
    def prompt_token_ids(self) -> List[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> List[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_confirmed_output_tokens(self) -> int:
        """Output tokens whose ids are known (placeholders left out)."""
        return len(self.token_ids) - self.num_prompt_tokens - self.num_pending_tokens

    @property
    def confirmed_output_token_ids(self) -> List[int]:
        return self.confirmed_output_token_ids_from(0)

    def confirmed_output_token_ids_from(self, start: int) -> List[int]:
        """``confirmed_output_token_ids[start:]`` without copying the first ``start``
        (the engine takes each step's new ids: O(new tokens), not O(output))."""
        return self.token_ids[self.num_prompt_tokens + start:
                              len(self.token_ids) - self.num_pending_tokens]

    @property
    def num_uncomputed_tokens(self) -> int:
        """Known tokens whose KV is not in the cache yet."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    def is_finished(self) -> bool:
        return self.status.is_finished()

    @property
    def num_confirmed_tokens(self) -> int:
        """Tokens whose ids are known (placeholders left out)."""
        return len(self.token_ids) - self.num_pending_tokens

    def update_block_hashes(self, block_size: int) -> List[BlockHash]:
        """Extend ``block_hashes`` over every full block of confirmed tokens; returns it.
        Confirmed tokens never change, so keys once computed stay valid (preemption
        keeps the tokens)."""
        hashes = self.block_hashes
        end = self.num_confirmed_tokens // block_size
        for i in range(len(hashes), end):
            parent = hashes[i - 1] if i else None
            tokens = self.token_ids[i * block_size:(i + 1) * block_size]
            hashes.append(hash_block_tokens(parent, tokens, self._block_extra_keys(i)))
        return hashes

    def _block_extra_keys(self, block_index: int) -> Tuple:
        """Extra keys of one block (see ``core/prefix_cache.py``)."""
        return self.extra_hash_keys

    def append_token(self, token_id: int) -> None:
        if self.num_pending_tokens:
            raise RuntimeError(f"{self!r}: a token appended behind a placeholder")
        self.token_ids.append(int(token_id))

    def append_placeholder(self, sample_row: int) -> int:
        """Stand-in for the token a step samples at ``sample_row``; returns its index."""
        self.token_ids.append(PLACEHOLDER_TOKEN)
        self.num_pending_tokens += 1
        self.last_sample_row = sample_row
        return len(self.token_ids) - 1

    def resolve_placeholder(self, index: int, token_id: int) -> None:
        """The step that samples ``token_ids[index]`` is done: write its id."""
        if self.token_ids[index] != PLACEHOLDER_TOKEN or self.num_pending_tokens < 1:
            raise RuntimeError(f"{self!r}: no placeholder at {index}")
        if index != len(self.token_ids) - self.num_pending_tokens:
            raise RuntimeError(f"{self!r}: placeholders resolved out of order at {index}")
        self.token_ids[index] = int(token_id)
        self.num_pending_tokens -= 1

    def drop_pending(self) -> None:
        """Forget the placeholders (the sequence finished before they were sampled)."""
        if self.num_pending_tokens:
            del self.token_ids[-self.num_pending_tokens:]
            self.num_pending_tokens = 0

    def stop_status(self, index: int, max_model_len: int
                    ) -> Tuple[Optional[SequenceStatus], Optional[int]]:
        """Why it stops after its token at ``index`` (the newest known one), if it does
        (``Scheduler.update``).

        EOS and stop tokens count only once ``min_tokens`` tokens were generated before
        them (vLLM's semantics: the stop token itself is not one of the min_tokens).
        """
        params, token = self.params, self.token_ids[index]
        num_output = index + 1 - self.num_prompt_tokens
        if num_output - 1 >= params.min_tokens:
            if not params.ignore_eos and token in self.eos_token_ids:
                return SequenceStatus.FINISHED_STOPPED, None
            if token in params.stop_token_ids:
                return SequenceStatus.FINISHED_STOPPED, token
        if self.max_tokens is not None and num_output >= self.max_tokens:
            return SequenceStatus.FINISHED_LENGTH, None
        if index + 1 >= max_model_len:
            return SequenceStatus.FINISHED_LENGTH, None
        return None, None

    def set_finished(
        self, status: SequenceStatus, stop_reason: Optional[Union[int, str]] = None
    ) -> None:
        if not status.is_finished():
            raise ValueError(f"set_finished needs a finished status, got {status}")
        self.status = status
        self.finish_reason = status.finish_reason
        self.stop_reason = stop_reason

    def __repr__(self) -> str:
        return (
            f"Sequence(seq_id={self.seq_id}, request_id={self.request_id!r}, "
            f"status={self.status.name}, tokens={self.num_tokens} "
            f"(prompt {self.num_prompt_tokens}), computed={self.num_computed_tokens}, "
            f"blocks={[len(b) for b in self.block_ids_by_group]}, state_slot={self.state_slot})"
        )

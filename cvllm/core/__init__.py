"""Scheduling core (rank 0 only, pure Python + numpy, never torch): sequences, KV block
bookkeeping, the continuous-batching scheduler and the StepInput wire format."""

from cvllm.core.block_manager import (
    PLACEHOLDER_BLOCK,
    BlockManager,
    BlockManagerError,
    NoFreeBlocksError,
)
from cvllm.core.kv_cache_manager import KVCacheGroupConfig, KVCacheLayout, KVCacheManager
from cvllm.core.scheduler import Scheduler
from cvllm.core.scheduler_output import ScheduledSeq, SchedulerOutput
from cvllm.core.sequence import Sequence, SequenceStatus
from cvllm.core.step_builder import build_step_input
from cvllm.core.step_input import StepInput, unpack_message
from cvllm.core.wire_format import ControlMessage, MessageHeader, MessageKind, StepInputError

__all__ = [
    "PLACEHOLDER_BLOCK", "BlockManager", "BlockManagerError", "NoFreeBlocksError",
    "KVCacheGroupConfig", "KVCacheLayout", "KVCacheManager", "ScheduledSeq", "Scheduler",
    "SchedulerOutput", "Sequence", "SequenceStatus", "ControlMessage", "MessageHeader",
    "MessageKind", "StepInput", "StepInputError", "build_step_input", "unpack_message",
]

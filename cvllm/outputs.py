"""What the engine hands back per request, per step.

Built by ``engine/`` on rank 0 after each step (one ``RequestOutput`` per request that
produced new text or finished), consumed by the server and by the offline ``LLM`` API.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional


@dataclass
class TokenLogprob:
    token_id: int
    token: str
    logprob: float
    top: Dict[str, float] = field(default_factory=dict)
    """The ``logprobs`` most likely tokens at this position (text -> log-probability)."""
    top_ids: Dict[int, float] = field(default_factory=dict)
    """The same by token id (two ids may decode to one text)."""


@dataclass
class RequestOutput:
    request_id: str
    delta_text: str
    """Text that became final in this step (never half a UTF-8 character)."""
    delta_token_ids: List[int]
    num_prompt_tokens: int
    num_output_tokens: int
    """All tokens generated so far, including those of this step."""
    finished: bool = False
    finish_reason: Optional[str] = None
    """'stop' (EOS, stop token or stop string), 'length' or 'abort'."""
    stop_reason: Optional[object] = None
    """The stop string or token id that ended the request, when there is one."""
    logprobs: List[TokenLogprob] = field(default_factory=list)
    """One entry per token of ``delta_token_ids`` when logprobs were requested."""
    num_cached_tokens: int = 0
    """Prompt tokens whose KV came from the prefix cache (``usage.prompt_tokens_details``)."""


@dataclass
class CompletionResult:
    """A whole generation, as returned by the offline ``LLM.generate``."""

    request_id: str
    prompt_token_ids: List[int]
    text: str
    token_ids: List[int]
    finish_reason: Optional[str]
    logprobs: List["TokenLogprob"] = field(default_factory=list)
    """One per generated token when the request asked for logprobs."""


@dataclass
class EngineMetrics:
    """A snapshot of the engine for ``/metrics`` and logs (rank 0 only)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_total: int = 0
    kv_blocks_free: int = 0
    """Blocks an allocation can take, cached prefixes nobody uses included."""
    kv_blocks_cached: int = 0
    """Of the free blocks, those holding a cached prefix (evicted only when needed)."""
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    num_preemptions_total: int = 0
    prefix_cache_queries_total: int = 0
    """Prompt tokens looked up in the prefix cache (first admissions)."""
    prefix_cache_hits_total: int = 0
    """Of those, tokens found there."""
    steps_total: int = 0
    requests_finished: Dict[str, int] = field(default_factory=dict)
    """Finished requests by finish reason."""

"""What the engine hands back per request, per step.

Built by ``engine/`` on rank 0 after each step (one ``RequestOutput`` per request that
produced new text or finished), consumed by the server and by the offline ``LLM`` API.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple


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


# Bucket upper bounds in seconds, vLLM's (``vllm/v1/metrics/loggers.py``), so dashboards
# built for vLLM read cvllm's histograms the same way.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                           40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


@dataclass
class Histogram:
    """Observations counted into buckets, as a Prometheus histogram exposes them.

    Owned and observed by the engine thread (rank 0); ``EngineMetrics`` carries copies.
    """

    buckets: Tuple[float, ...]
    """Upper bounds, increasing; a last +Inf bucket is implied."""
    counts: List[int] = field(default_factory=list)
    """Observations per bucket, not cumulative: ``len(buckets) + 1`` entries (+Inf last)."""
    sum: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.buckets, value)] += 1  # bucket ``le`` counts value <= le
        self.sum += value
        self.count += 1

    def copy(self) -> "Histogram":
        return Histogram(self.buckets, list(self.counts), self.sum, self.count)


@dataclass
class LatencyHistograms:
    """Per engine request (one per choice of an ``n > 1`` request), in seconds, from the
    moment the engine took the request (``LLMEngine.add_request``)."""

    time_to_first_token: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    """Arrival to the step output that carries the first generated token."""
    inter_token_latency: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))
    """Between two step outputs of one request that carry generated tokens."""
    e2e_request_latency: Histogram = field(
        default_factory=lambda: Histogram(REQUEST_LATENCY_BUCKETS))
    """Arrival to the final output, for requests that finish (stop or length; not aborts)."""
    request_queue_time: Histogram = field(
        default_factory=lambda: Histogram(REQUEST_LATENCY_BUCKETS))
    """Arrival to the first step that schedules the request, observed when it finishes."""

    def copy(self) -> "LatencyHistograms":
        return LatencyHistograms(self.time_to_first_token.copy(), self.inter_token_latency.copy(),
                                 self.e2e_request_latency.copy(), self.request_queue_time.copy())


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
    latency: LatencyHistograms = field(default_factory=LatencyHistograms)
    """Request latency histograms (a copy: the engine thread goes on observing)."""

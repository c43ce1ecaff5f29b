"""``GET /metrics``: the engine's numbers in Prometheus's formats, through ``prometheus_client``.

Who counts: only the engine thread on rank 0 (``LLMEngine``: the request and token
counters, the KV-cache gauges and the latency histograms). The server counts nothing of
its own. The numbers reach it as one plain-data snapshot (``EngineMetrics``): in one
process from the engine thread, which hands over a new one each step; in the API process
(``remote_engine.py``) asked of rank 0 over the channel at each scrape. So the engine's
numbers are carried to the collector of the process that answers the scrape, and
prometheus_client's multiprocess mode (a directory of per-process files) is not needed:
one process counts, one answers, and the API process shows exactly what rank 0 counted.

``build_registry(engine.metrics)`` is called once per application by ``app.build_app``: a
``CollectorRegistry`` of the application's own (never prometheus_client's process-global
``REGISTRY``, which would add this process's own gc/process series and clash between two
applications in one process), holding one ``EngineCollector`` that turns the engine's
latest snapshot (``engine.metrics()``) into metric families when a scrape collects.
``exposition`` writes them in the format the scrape's ``Accept`` header asks for:
OpenMetrics for ``application/openmetrics-text``, else the classic text format 0.0.4.
"""

from __future__ import annotations

from itertools import accumulate
from typing import Callable, Iterator, Optional, Tuple

from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import (CounterMetricFamily, GaugeMetricFamily,
                                            HistogramMetricFamily, Metric)
from prometheus_client.utils import floatToGoString

from cvllm.outputs import EngineMetrics, Histogram

# (name, type, help, EngineMetrics attribute)
_SCALARS = (
    ("cvllm_num_requests_running", "gauge", "Requests being generated now.", "num_running"),
    ("cvllm_num_requests_waiting", "gauge", "Requests queued for their first step.",
     "num_waiting"),
    ("cvllm_kv_blocks_total", "gauge", "KV-cache blocks in the pool.", "kv_blocks_total"),
    ("cvllm_kv_blocks_free", "gauge", "KV-cache blocks not in use (cached ones included).",
     "kv_blocks_free"),
    ("cvllm_kv_blocks_cached", "gauge",
     "Free KV-cache blocks that hold a cached prefix (evicted only when needed).",
     "kv_blocks_cached"),
    ("cvllm_prefix_cache_queries_total", "counter",
     "Prompt tokens looked up in the prefix cache.", "prefix_cache_queries_total"),
    ("cvllm_prefix_cache_hits_total", "counter",
     "Prompt tokens found in the prefix cache.", "prefix_cache_hits_total"),
    ("cvllm_prompt_tokens_total", "counter", "Prompt tokens processed.",
     "prompt_tokens_total"),
    ("cvllm_generation_tokens_total", "counter", "Tokens generated.",
     "generation_tokens_total"),
    ("cvllm_preemptions_total", "counter", "Sequences preempted for lack of KV blocks.",
     "num_preemptions_total"),
    ("cvllm_steps_total", "counter", "Engine steps run.", "steps_total"),
)
_FAMILY = {"gauge": GaugeMetricFamily, "counter": CounterMetricFamily}
# Always exported, so dashboards see a 0 rather than a missing series.
_FINISH_REASONS = ("stop", "length", "abort")
# (name, help, LatencyHistograms attribute); vLLM's names with the cvllm_ prefix.
_HISTOGRAMS = (
    ("cvllm_time_to_first_token_seconds",
     "Time from a request's arrival to its first generated token.", "time_to_first_token"),
    ("cvllm_inter_token_latency_seconds",
     "Time between two outputs of a request that carry generated tokens.",
     "inter_token_latency"),
    ("cvllm_e2e_request_latency_seconds",
     "Time from a request's arrival to its last output (finished requests).",
     "e2e_request_latency"),
    ("cvllm_request_queue_time_seconds",
     "Time a request waited before its first step (finished requests).",
     "request_queue_time"),
)


def metric_families(metrics: EngineMetrics) -> Iterator[Metric]:
    """One snapshot as prometheus_client metric families, in a fixed order."""
    for name, kind, help_text, attr in _SCALARS:
        yield _FAMILY[kind](name, help_text, value=getattr(metrics, attr, 0))
    finished = CounterMetricFamily("cvllm_request_success_total",
                                   "Finished requests by finish reason.",
                                   labels=["finish_reason"])
    counts = dict.fromkeys(_FINISH_REASONS, 0)
    counts.update(metrics.requests_finished or {})
    for reason, count in counts.items():
        finished.add_metric([str(reason)], count)
    yield finished
    for name, help_text, attr in _HISTOGRAMS:
        yield _histogram(name, help_text, getattr(metrics.latency, attr))


def _histogram(name: str, help_text: str, h: Histogram) -> HistogramMetricFamily:
    # The engine counts per bucket; the exposition's buckets are cumulative, +Inf last.
    bounds = [*map(floatToGoString, h.buckets), "+Inf"]
    return HistogramMetricFamily(name, help_text, sum_value=h.sum,
                                 buckets=list(zip(bounds, accumulate(h.counts))))


class EngineCollector:
    """A prometheus_client collector of the engine's snapshot that ``snapshot()`` gives
    (``engine.metrics()``: the latest one, which the route refreshes before it collects)."""

    def __init__(self, snapshot: Callable[[], EngineMetrics]):
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        return metric_families(self._snapshot())


def build_registry(snapshot: Callable[[], EngineMetrics]) -> CollectorRegistry:
    """A registry of the caller's own, collecting ``snapshot()``."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(snapshot))
    return registry


REGISTRY_KEY = web.AppKey("cvllm_metrics_registry", CollectorRegistry)


def exposition(registry: CollectorRegistry, accept: Optional[str]) -> Tuple[bytes, str]:
    """(body, content type) of a scrape, in the format its ``Accept`` header asks for."""
    encoder, content_type = choose_encoder(accept or "")
    return encoder(registry), content_type


"""Prometheus text exposition (format 0.0.4) of an ``EngineMetrics`` snapshot.

Rendered by the /metrics route on rank 0 from ``engine.metrics()``; no client library, as
the format is a few lines of text: the values live in the engine thread, which hands the
server a plain-data snapshot (``EngineMetrics``, latency histograms included) each step, so
``prometheus_client``'s process-global registry and its locks would only mirror them (and
make one more dependency of the torch-free server).
"""

from __future__ import annotations

from typing import List

from cvllm.outputs import EngineMetrics, Histogram

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

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


def _label_value(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render_metrics(metrics: EngineMetrics) -> str:
    lines: List[str] = []
    for name, kind, help_text, attr in _SCALARS:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}",
                  f"{name} {getattr(metrics, attr, 0)}"]
    name = "cvllm_request_success_total"
    lines += [f"# HELP {name} Finished requests by finish reason.", f"# TYPE {name} counter"]
    finished = dict.fromkeys(_FINISH_REASONS, 0)
    finished.update(metrics.requests_finished or {})
    for reason, count in finished.items():
        lines.append(f'{name}{{finish_reason="{_label_value(str(reason))}"}} {count}')
    for name, help_text, attr in _HISTOGRAMS:
        lines += _histogram_lines(name, help_text, getattr(metrics.latency, attr))
    return "\n".join(lines) + "\n"


def _histogram_lines(name: str, help_text: str, h: Histogram) -> List[str]:
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
    cumulative = 0
    for le, n in zip([*map(repr, h.buckets), "+Inf"], h.counts):
        cumulative += n
        lines.append(f'{name}_bucket{{le="{le}"}} {cumulative}')
    lines += [f"{name}_sum {h.sum!r}", f"{name}_count {h.count}"]
    return lines

"""Prometheus text exposition (format 0.0.4) of an ``EngineMetrics`` snapshot.

Rendered by the /metrics route on rank 0 from ``engine.metrics()``; no client library, as
the format is a few lines of text.
"""

from __future__ import annotations

from typing import List

from cvllm.outputs import EngineMetrics

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
    return "\n".join(lines) + "\n"

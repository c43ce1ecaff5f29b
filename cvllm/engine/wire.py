"""The engine's boundary objects as JSON values, for the channel to the API process.

``SamplingParams``, ``RequestOutput`` (with its ``TokenLogprob`` s) and ``EngineMetrics``
in and out of plain lists / dicts (``utils/channel.py`` frames them). Encoded by the side
that owns the object (the API process encodes sampling params, rank 0's engine process
outputs and metrics) and decoded, with every field's type checked, by the other. Decoding
builds the real dataclasses, so their own validation (``SamplingParams.validate``) runs
again on the receiving side. Torch-free: the API process imports it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional

from cvllm.outputs import (EngineMetrics, Histogram, LatencyHistograms, RequestOutput,
                           TokenLogprob)
from cvllm.sampling_params import SamplingParams, StructuredOutputs

MAX_ID_CHARS = 512
"""Longest request id accepted from the wire."""


class WireError(ValueError):
    """A value from the channel does not have the shape its kind promises."""


def want(value: Any, kind: Any, what: str) -> Any:
    """``value`` if it is a ``kind`` (a bool is no int here), else ``WireError``."""
    if kind is int and isinstance(value, bool) or not isinstance(value, kind):
        name = getattr(kind, "__name__", None) or "/".join(k.__name__ for k in kind)
        raise WireError(f"{what}: expected {name}, got {type(value).__name__}")
    return value


def request_id(value: Any) -> str:
    want(value, str, "request id")
    if not 0 < len(value) <= MAX_ID_CHARS:
        raise WireError(f"request id of {len(value)} characters")
    return value


def token_ids(value: Any, what: str = "token ids") -> List[int]:
    want(value, list, what)
    for t in value:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < 1 << 31:
            raise WireError(f"{what}: {t!r} is not a token id")
    return value


# ---------------------------------------------------------------- sampling params
_NUMBER = (int, float)
_PARAM_KINDS: Dict[str, str] = {
    "temperature": "number", "top_p": "number", "top_k": "int", "min_p": "number",
    "presence_penalty": "number", "frequency_penalty": "number",
    "repetition_penalty": "number", "seed": "int?", "max_tokens": "int?", "min_tokens": "int",
    "stop": "strings", "stop_token_ids": "ids", "ignore_eos": "bool", "n": "int",
    "logprobs": "int?", "skip_special_tokens": "bool", "structured_outputs": "constraint",
}
"""Each ``SamplingParams`` field's JSON kind (a test holds it to the dataclass's fields)."""


def params_to_wire(p: SamplingParams) -> Dict[str, Any]:
    return dataclasses.asdict(p)


def _param(name: str, v: Any) -> Any:
    kind = _PARAM_KINDS[name]
    if kind.endswith("?"):
        if v is None:
            return None
        kind = kind[:-1]
    if kind == "number":
        if isinstance(v, bool):
            raise WireError(f"{name}: expected a number, got bool")
        return float(want(v, _NUMBER, name))
    if kind == "int":
        return want(v, int, name)
    if kind == "bool":
        return want(v, bool, name)
    if kind == "strings":
        return [want(x, str, name) for x in want(v, list, name)]
    if kind == "ids":
        return token_ids(v, name)
    if v is None:  # the constraint
        return None
    want(v, dict, name)
    return StructuredOutputs(kind=want(v.get("kind"), str, name + ".kind"),
                             value=optional_str(v.get("value"), name + ".value"))


def params_from_wire(d: Any) -> SamplingParams:
    """Each field's type checked here, then ``SamplingParams`` validates the values."""
    want(d, dict, "sampling params")
    unknown = set(d) - set(_PARAM_KINDS)
    if unknown:
        raise WireError(f"unknown sampling fields {sorted(unknown)}")
    return SamplingParams(**{k: _param(k, v) for k, v in d.items()})


# ---------------------------------------------------------------- outputs
def _logprob_to_wire(lp: TokenLogprob) -> list:
    return [lp.token_id, lp.token, lp.logprob, [[t, v] for t, v in lp.top.items()],
            [[i, v] for i, v in lp.top_ids.items()]]


def _logprob_from_wire(v: Any) -> TokenLogprob:
    want(v, list, "logprob")
    if len(v) != 5:
        raise WireError("logprob: 5 fields expected")
    token_id, token, logprob, top, top_ids = v
    return TokenLogprob(want(token_id, int, "logprob id"), want(token, str, "logprob token"),
                        float(want(logprob, (int, float), "logprob")),
                        {str(t): float(x) for t, x in want(top, list, "top")},
                        {int(i): float(x) for i, x in want(top_ids, list, "top ids")})


def output_to_wire(o: RequestOutput) -> list:
    return [o.request_id, o.delta_text, o.delta_token_ids, o.num_prompt_tokens,
            o.num_output_tokens, o.finished, o.finish_reason, o.stop_reason,
            o.num_cached_tokens, [_logprob_to_wire(lp) for lp in o.logprobs] or None]


def output_from_wire(v: Any) -> RequestOutput:
    want(v, list, "output")
    if len(v) != 10:
        raise WireError(f"output: 10 fields expected, got {len(v)}")
    rid, text, ids, n_prompt, n_out, finished, reason, stop, cached, lps = v
    if reason is not None:
        want(reason, str, "finish reason")
    if stop is not None and not isinstance(stop, (str, int)):
        raise WireError("stop reason: a string or a token id expected")
    return RequestOutput(
        request_id(rid), want(text, str, "text"), token_ids(ids),
        want(n_prompt, int, "prompt tokens"), want(n_out, int, "output tokens"),
        finished=bool(want(finished, bool, "finished")), finish_reason=reason,
        stop_reason=stop, num_cached_tokens=want(cached, int, "cached tokens"),
        logprobs=[_logprob_from_wire(x) for x in want(lps, list, "logprobs")] if lps else [])


# ---------------------------------------------------------------- metrics
def metrics_to_wire(m: EngineMetrics) -> Dict[str, Any]:
    return dataclasses.asdict(m)


def _histogram(d: Any, what: str) -> Histogram:
    want(d, dict, what)
    buckets = tuple(float(b) for b in want(d.get("buckets"), (list, tuple), what + " buckets"))
    counts = [int(c) for c in want(d.get("counts"), list, what + " counts")]
    if len(counts) != len(buckets) + 1:
        raise WireError(f"{what}: {len(counts)} counts for {len(buckets)} buckets")
    return Histogram(buckets, counts, float(d.get("sum", 0.0)), int(d.get("count", 0)))


def metrics_from_wire(d: Any) -> EngineMetrics:
    want(d, dict, "metrics")
    lat = want(d.get("latency"), dict, "latency")
    latency = LatencyHistograms(**{f.name: _histogram(lat.get(f.name), f.name)
                                   for f in dataclasses.fields(LatencyHistograms)})
    plain = {f.name: d[f.name] for f in dataclasses.fields(EngineMetrics)
             if f.name not in ("latency", "requests_finished") and f.name in d}
    for k, v in plain.items():
        want(v, int, k)
    finished = {str(k): int(v) for k, v in want(d.get("requests_finished", {}), dict,
                                                 "requests_finished").items()}
    return EngineMetrics(**plain, requests_finished=finished, latency=latency)


def optional_str(v: Any, what: str) -> Optional[str]:
    return None if v is None else want(v, str, what)

"""Typed fields of a request body, and the fields chat and completions share.

The per-field checks (number, integer, boolean, stop strings, token ids) raise an
``ApiError`` naming the field; ``parse_common`` reads model, stream, stream_options, n and
the sampling fields both endpoints accept. Types are checked here; value ranges are left to
``SamplingParams.validate`` so there is one source of truth for them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Dict, List, Optional

from cvllm.server.errors import ApiError


def bad_param(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param)


def float_field(body: dict, name: str) -> Optional[float]:
    value = body.get(name)
    if value is None:  # null means "not given", as the OpenAI API treats it
        return None
    # bool is an int subclass in Python; `true` is never a valid number here.
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad_param(name, f"'{name}' must be a number, got {value!r}")
    return float(value)


def int_field(body: dict, name: str, minimum: Optional[int] = None) -> Optional[int]:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_param(name, f"'{name}' must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise bad_param(name, f"'{name}' must be >= {minimum}, got {value}")
    return value


def bool_field(body: dict, name: str, param: Optional[str] = None) -> Optional[bool]:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, bool):
        raise bad_param(param or name, f"'{param or name}' must be a boolean, got {value!r}")
    return value


def _stop(body: dict) -> Optional[List[str]]:
    value = body.get("stop")
    if value is None:
        return None
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return list(value)
    raise bad_param("stop", "'stop' must be a string or a list of strings")


def _int_list(body: dict, name: str) -> Optional[List[int]]:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, list) and all(is_token_id(t) for t in value):
        return list(value)
    raise bad_param(name, f"'{name}' must be a list of non-negative integers")


def is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


@dataclass
class SamplingFields:
    """Sampling values a client set explicitly; None means "use the server default"."""

    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None
    seed: Optional[int] = None
    min_tokens: Optional[int] = None
    stop: Optional[List[str]] = None
    stop_token_ids: Optional[List[int]] = None
    ignore_eos: Optional[bool] = None
    skip_special_tokens: Optional[bool] = None

    def overrides(self) -> Dict[str, Any]:
        """The fields the client set, keyed like ``SamplingParams``."""
        values = ((f.name, getattr(self, f.name)) for f in fields(self))
        return {name: value for name, value in values if value is not None}


_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty")
_INT_FIELDS = ("top_k", "seed", "min_tokens")
_BOOL_FIELDS = ("ignore_eos", "skip_special_tokens")


def _parse_sampling(body: dict) -> SamplingFields:
    values: Dict[str, Any] = {name: float_field(body, name) for name in _FLOAT_FIELDS}
    values.update({name: int_field(body, name) for name in _INT_FIELDS})
    values.update({name: bool_field(body, name) for name in _BOOL_FIELDS})
    values["stop"] = _stop(body)
    values["stop_token_ids"] = _int_list(body, "stop_token_ids")
    return SamplingFields(**values)


def parse_common(body: dict) -> Dict[str, Any]:
    """Fields shared by chat and completions requests."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_param("model", "'model' must be a string")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict):
            raise bad_param("stream_options", "'stream_options' must be an object")
        include_usage = bool(bool_field(options, "include_usage", "stream_options.include_usage"))
    n = int_field(body, "n", minimum=1)
    return dict(model=model, stream=bool(bool_field(body, "stream")), include_usage=include_usage,
                n=1 if n is None else n, sampling=_parse_sampling(body))

"""OpenAI JSON shapes: request parsing and validation, response and chunk building.

The only module in cvllm that knows what OpenAI requests and responses look like. The
server's handlers (rank 0, event-loop thread) call it per HTTP request; it knows nothing of
aiohttp or the engine, so it is tested with plain dicts. Types are checked here; value
ranges are left to ``SamplingParams.validate`` so there is one source of truth for them.
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass, field, fields
from typing import Any, Dict, List, Optional, Sequence, Union

from cvllm.outputs import TokenLogprob

CHAT_ROLES = ("system", "user", "assistant", "tool")
# Message keys templates use besides role/content (tool calling, names); passed through.
_MESSAGE_PASSTHROUGH = ("name", "tool_calls", "tool_call_id", "reasoning_content")
_RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "bos_token", "eos_token"})
# OpenAI clients cannot parse -Infinity; a very negative finite number reads the same.
_MIN_LOGPROB = -9999.0


class ApiError(Exception):
    """An error answered to the client as ``{"error": {...}}`` with an HTTP status."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error",
               param: Optional[str] = None, code: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def context_length_error(max_model_len: int, prompt_len: int, param: str) -> ApiError:
    return ApiError(400, f"This model's maximum context length is {max_model_len} tokens; "
                         f"your prompt has {prompt_len} tokens, which leaves no room to "
                         f"generate. Please shorten the prompt.",
                    param=param, code="context_length_exceeded")


# --------------------------------------------------------------------------- parsing

def parse_json_body(raw: bytes) -> dict:
    """Decode a request body; anything but a JSON object of valid Unicode text is a 400.

    Invalid UTF-8 (as OpenAI does) and lone UTF-16 surrogates are refused rather than
    replaced: a replacement would silently change the prompt, and a surrogate cannot be
    encoded for the tokenizer, a log line or a response.
    """
    if not raw:
        raise ApiError(400, "The request body is empty; expected a JSON object.")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"The request body is not valid UTF-8 (at byte {exc.start}).") \
            from None
    try:
        body = json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:
        raise ApiError(400, f"The request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "The request body must be a JSON object.")
    # After a strict decode only a \uD800-\uDFFF escape can make a surrogate.
    if _SURROGATE_ESCAPE.search(text):
        where = _lone_surrogate_at(body)
        if where is not None:
            raise ApiError(400, f"'{where}' contains a lone UTF-16 surrogate (an unpaired "
                                f"\\ud800-\\udfff escape); send valid Unicode text.",
                           param=where, code="invalid_unicode")
    return body


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def _lone_surrogate_at(body: dict) -> Optional[str]:
    """The path (``messages[0].content``) of the first string or key holding a surrogate."""
    stack: List[tuple] = [("", body)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if _SURROGATE.search(value):
                return path
        elif isinstance(value, dict):
            for key, item in reversed(list(value.items())):
                key_path = f"{path}.{key}" if path else key
                if _SURROGATE.search(key):  # shown escaped: the path is echoed back
                    return key_path.encode("utf-8", "backslashreplace").decode("utf-8")
                stack.append((key_path, item))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", item) for i, item in reversed(list(enumerate(value))))
    return None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed")


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param)


def _float(body: dict, name: str) -> Optional[float]:
    value = body.get(name)
    if value is None:  # null means "not given", as the OpenAI API treats it
        return None
    # bool is an int subclass in Python; `true` is never a valid number here.
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _bad(name, f"'{name}' must be a number, got {value!r}")
    return float(value)


def _int(body: dict, name: str, minimum: Optional[int] = None) -> Optional[int]:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(name, f"'{name}' must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise _bad(name, f"'{name}' must be >= {minimum}, got {value}")
    return value


def _bool(body: dict, name: str, param: Optional[str] = None) -> Optional[bool]:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, bool):
        raise _bad(param or name, f"'{param or name}' must be a boolean, got {value!r}")
    return value


def _stop(body: dict) -> Optional[List[str]]:
    value = body.get("stop")
    if value is None:
        return None
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return list(value)
    raise _bad("stop", "'stop' must be a string or a list of strings")


def _int_list(body: dict, name: str) -> Optional[List[int]]:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, list) and all(_is_token_id(t) for t in value):
        return list(value)
    raise _bad(name, f"'{name}' must be a list of non-negative integers")


def _is_token_id(value: Any) -> bool:
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
    values: Dict[str, Any] = {name: _float(body, name) for name in _FLOAT_FIELDS}
    values.update({name: _int(body, name) for name in _INT_FIELDS})
    values.update({name: _bool(body, name) for name in _BOOL_FIELDS})
    values["stop"] = _stop(body)
    values["stop_token_ids"] = _int_list(body, "stop_token_ids")
    return SamplingFields(**values)


@dataclass
class ChatCompletionRequest:
    """A validated ``POST /v1/chat/completions`` body."""

    messages: List[dict]
    """Normalized messages: ``content`` is always a string."""
    model: Optional[str] = None
    stream: bool = False
    include_usage: bool = False
    max_tokens: Optional[int] = None
    """``max_completion_tokens`` if given, else ``max_tokens``; None means server default."""
    n: int = 1
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    chat_template_kwargs: Dict[str, Any] = field(default_factory=dict)
    sampling: SamplingFields = field(default_factory=SamplingFields)

    @property
    def num_logprobs(self) -> Optional[int]:
        """``SamplingParams.logprobs``: top-k count per token, or None for no logprobs."""
        return (self.top_logprobs or 0) if self.logprobs else None


@dataclass
class CompletionRequest:
    """A validated ``POST /v1/completions`` body."""

    prompt: Union[str, List[int]]
    """Text to tokenize, or token ids used as they are."""
    model: Optional[str] = None
    stream: bool = False
    include_usage: bool = False
    max_tokens: Optional[int] = None
    n: int = 1
    logprobs: Optional[int] = None
    sampling: SamplingFields = field(default_factory=SamplingFields)

    @property
    def num_logprobs(self) -> Optional[int]:
        return self.logprobs


def _parse_common(body: dict) -> Dict[str, Any]:
    """Fields shared by chat and completions requests."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("model", "'model' must be a string")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict):
            raise _bad("stream_options", "'stream_options' must be an object")
        include_usage = bool(_bool(options, "include_usage", "stream_options.include_usage"))
    n = _int(body, "n", minimum=1)
    return dict(model=model, stream=bool(_bool(body, "stream")), include_usage=include_usage,
                n=1 if n is None else n, sampling=_parse_sampling(body))


def parse_chat_request(body: dict) -> ChatCompletionRequest:
    common = _parse_common(body)
    messages = _parse_messages(body.get("messages"))
    max_completion = _int(body, "max_completion_tokens", minimum=1)
    max_tokens = _int(body, "max_tokens", minimum=1)
    logprobs = bool(_bool(body, "logprobs"))
    top_logprobs = _int(body, "top_logprobs", minimum=0)
    if top_logprobs is not None and not logprobs:
        raise _bad("top_logprobs", "'top_logprobs' requires 'logprobs' to be true")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise _bad("chat_template_kwargs", "'chat_template_kwargs' must be an object")
    # Arguments the engine's render_chat passes itself; a clash would be a TypeError (500).
    kwargs = {k: v for k, v in kwargs.items() if k not in _RESERVED_TEMPLATE_KWARGS}
    return ChatCompletionRequest(
        messages=messages, max_tokens=max_completion if max_completion is not None else max_tokens,
        logprobs=logprobs, top_logprobs=top_logprobs, chat_template_kwargs=kwargs, **common)


def _parse_messages(value: Any) -> List[dict]:
    if value is None:
        raise _bad("messages", "'messages' is required")
    if not isinstance(value, list):
        raise _bad("messages", "'messages' must be a list of message objects")
    if not value:
        raise _bad("messages", "'messages' must not be empty")
    return [_parse_message(i, m) for i, m in enumerate(value)]


def _parse_message(index: int, message: Any) -> dict:
    param = f"messages[{index}]"
    if not isinstance(message, dict):
        raise _bad(param, f"'{param}' must be an object with 'role' and 'content'")
    role = message.get("role")
    if role not in CHAT_ROLES:
        raise _bad(f"{param}.role", f"'{param}.role' must be one of {', '.join(CHAT_ROLES)}; "
                                    f"got {role!r}")
    normalized = {k: message[k] for k in _MESSAGE_PASSTHROUGH if message.get(k) is not None}
    normalized["role"] = role
    normalized["content"] = _message_text(message.get("content"), role, f"{param}.content")
    return normalized


def _message_text(content: Any, role: str, param: str) -> str:
    if isinstance(content, str):
        return content
    if content is None and role == "assistant":  # assistant turns that only call tools
        return ""
    if isinstance(content, list):
        texts = []
        for i, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):
                raise _bad(f"{param}[{i}]", f"'{param}[{i}]' must be a text part ({{'type': "
                                            "'text', 'text': ...}); only text is supported")
            texts.append(part["text"])
        return "\n".join(texts)
    raise _bad(param, f"'{param}' must be a string or a list of text parts")


def parse_completion_request(body: dict) -> CompletionRequest:
    common = _parse_common(body)
    if body.get("echo"):
        raise _bad("echo", "'echo' is not supported")
    return CompletionRequest(prompt=_parse_prompt(body.get("prompt")),
                             max_tokens=_int(body, "max_tokens", minimum=1),
                             logprobs=_int(body, "logprobs", minimum=0), **common)


def _parse_prompt(value: Any) -> Union[str, List[int]]:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        return _parse_prompt(value[0])
    if isinstance(value, list) and value and all(_is_token_id(t) for t in value):
        return list(value)
    if isinstance(value, list) and len(value) > 1 and all(isinstance(p, str) for p in value):
        raise _bad("prompt", "Batched prompts are not supported; send one prompt per request")
    raise _bad("prompt", "'prompt' must be a string, a list of one string, or a non-empty "
                         "list of token ids")


# --------------------------------------------------------------------------- responses

@dataclass
class ChoiceResult:
    """One finished choice, as the handlers accumulated it from ``RequestOutput``s."""

    index: int
    text: str
    finish_reason: Optional[str]
    num_output_tokens: int
    logprobs: List[TokenLogprob] = field(default_factory=list)
    num_cached_tokens: int = 0
    """Prompt tokens this choice's engine request took from the prefix cache."""


def cached_prompt_tokens(per_choice: Sequence[int]) -> int:
    """A request's ``cached_tokens`` when its n choices ran as n engine requests: the
    prompt tokens none of them computed (the first choice usually computes the prompt
    and the others reuse its blocks, which saves compute but is not a cache hit for the
    request)."""
    return min(per_choice, default=0)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def model_card(model_id: str, max_model_len: int, created: int) -> dict:
    return {"id": model_id, "object": "model", "created": created, "owned_by": "cvllm",
            "max_model_len": max_model_len}


def model_list(cards: Sequence[dict]) -> dict:
    return {"object": "list", "data": list(cards)}


def _lp(value: float) -> float:
    return max(float(value), _MIN_LOGPROB)


def _token_entry(token: str, logprob: float) -> dict:
    return {"token": token, "logprob": _lp(logprob), "bytes": list(token.encode("utf-8"))}


def chat_logprobs(entries: Sequence[TokenLogprob]) -> dict:
    content = []
    for e in entries:
        item = _token_entry(e.token, e.logprob)
        item["top_logprobs"] = [_token_entry(t, v) for t, v in e.top.items()]
        content.append(item)
    return {"content": content}


def completion_logprobs(entries: Sequence[TokenLogprob], text_offset: int) -> dict:
    offsets = []
    for e in entries:
        offsets.append(text_offset)
        text_offset += len(e.token)
    return {"tokens": [e.token for e in entries],
            "token_logprobs": [_lp(e.logprob) for e in entries],
            "top_logprobs": [{t: _lp(v) for t, v in e.top.items()} for e in entries],
            "text_offset": offsets}


class _Shapes:
    """Builds the bodies of one request's response; subclasses fix the OpenAI flavour."""

    object_name = ""
    chunk_object = ""

    def __init__(self, request_id: str, model: str, include_usage: bool = False,
                 num_logprobs: Optional[int] = None):
        self.request_id = request_id
        self.model = model
        self.include_usage = include_usage
        self.want_logprobs = num_logprobs is not None
        self.created = int(time.time())

    def _envelope(self, obj: str, choices: list) -> dict:
        return {"id": self.request_id, "object": obj, "created": self.created,
                "model": self.model, "choices": choices}

    def _chunk(self, choice: dict) -> dict:
        chunk = self._envelope(self.chunk_object, [choice])
        if self.include_usage:  # OpenAI sends usage: null on every chunk but the last
            chunk["usage"] = None
        return chunk

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int,
                    cached_tokens: int = 0) -> dict:
        chunk = self._envelope(self.chunk_object, [])
        chunk["usage"] = usage(prompt_tokens, completion_tokens, cached_tokens)
        return chunk

    def response(self, choices: Sequence[ChoiceResult], prompt_tokens: int) -> dict:
        body = self._envelope(self.object_name, [self._choice(c) for c in choices])
        body["usage"] = usage(prompt_tokens, sum(c.num_output_tokens for c in choices),
                              cached_prompt_tokens([c.num_cached_tokens for c in choices]))
        return body

    def _choice(self, c: ChoiceResult) -> dict:  # pragma: no cover - abstract
        raise NotImplementedError


class ChatShapes(_Shapes):
    object_name = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def stream_start(self, index: int) -> Optional[dict]:
        return self._chunk({"index": index, "delta": {"role": "assistant", "content": ""},
                            "logprobs": None, "finish_reason": None})

    def stream_delta(self, index: int, text: str, logprobs: Sequence[TokenLogprob],
                     text_offset: int = 0) -> dict:
        lp = chat_logprobs(logprobs) if self.want_logprobs else None
        return self._chunk({"index": index, "delta": {"content": text}, "logprobs": lp,
                            "finish_reason": None})

    def stream_finish(self, index: int, finish_reason: str) -> dict:
        return self._chunk({"index": index, "delta": {}, "logprobs": None,
                            "finish_reason": finish_reason})

    def _choice(self, c: ChoiceResult) -> dict:
        return {"index": c.index, "message": {"role": "assistant", "content": c.text},
                "logprobs": chat_logprobs(c.logprobs) if self.want_logprobs else None,
                "finish_reason": c.finish_reason}


class CompletionShapes(_Shapes):
    object_name = "text_completion"
    chunk_object = "text_completion"

    def stream_start(self, index: int) -> Optional[dict]:
        return None  # completions have no role chunk

    def stream_delta(self, index: int, text: str, logprobs: Sequence[TokenLogprob],
                     text_offset: int = 0) -> dict:
        lp = completion_logprobs(logprobs, text_offset) if self.want_logprobs else None
        return self._chunk({"index": index, "text": text, "logprobs": lp,
                            "finish_reason": None})

    def stream_finish(self, index: int, finish_reason: str) -> dict:
        return self._chunk({"index": index, "text": "", "logprobs": None,
                            "finish_reason": finish_reason})

    def _choice(self, c: ChoiceResult) -> dict:
        lp = completion_logprobs(c.logprobs, 0) if self.want_logprobs else None
        return {"index": c.index, "text": c.text, "logprobs": lp,
                "finish_reason": c.finish_reason}

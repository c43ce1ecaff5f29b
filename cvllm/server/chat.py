"""``POST /v1/chat/completions``: the request's parsing and the response's shapes.

Called per HTTP request by the handlers (rank 0, event-loop thread); knows nothing of
aiohttp or the engine, so it is tested with plain dicts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

from cvllm.outputs import TokenLogprob
from cvllm.server.request_fields import (SamplingFields, bad_param, bool_field, int_field,
                                         parse_common)
from cvllm.server.responses import ChoiceResult, ResponseShapes, clamp_logprob

CHAT_ROLES = ("system", "user", "assistant", "tool")
# Message keys templates use besides role/content (tool calling, names); passed through.
_MESSAGE_PASSTHROUGH = ("name", "tool_calls", "tool_call_id", "reasoning_content")
_RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "bos_token", "eos_token"})


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


def parse_chat_request(body: dict) -> ChatCompletionRequest:
    common = parse_common(body)
    messages = _parse_messages(body.get("messages"))
    max_completion = int_field(body, "max_completion_tokens", minimum=1)
    max_tokens = int_field(body, "max_tokens", minimum=1)
    logprobs = bool(bool_field(body, "logprobs"))
    top_logprobs = int_field(body, "top_logprobs", minimum=0)
    if top_logprobs is not None and not logprobs:
        raise bad_param("top_logprobs", "'top_logprobs' requires 'logprobs' to be true")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise bad_param("chat_template_kwargs", "'chat_template_kwargs' must be an object")
    # Arguments the engine's render_chat passes itself; a clash would be a TypeError (500).
    kwargs = {k: v for k, v in kwargs.items() if k not in _RESERVED_TEMPLATE_KWARGS}
    return ChatCompletionRequest(
        messages=messages, max_tokens=max_completion if max_completion is not None else max_tokens,
        logprobs=logprobs, top_logprobs=top_logprobs, chat_template_kwargs=kwargs, **common)


def _parse_messages(value: Any) -> List[dict]:
    if value is None:
        raise bad_param("messages", "'messages' is required")
    if not isinstance(value, list):
        raise bad_param("messages", "'messages' must be a list of message objects")
    if not value:
        raise bad_param("messages", "'messages' must not be empty")
    return [_parse_message(i, m) for i, m in enumerate(value)]


def _parse_message(index: int, message: Any) -> dict:
    param = f"messages[{index}]"
    if not isinstance(message, dict):
        raise bad_param(param, f"'{param}' must be an object with 'role' and 'content'")
    role = message.get("role")
    if role not in CHAT_ROLES:
        raise bad_param(f"{param}.role", f"'{param}.role' must be one of {', '.join(CHAT_ROLES)}; "
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
                raise bad_param(f"{param}[{i}]", f"'{param}[{i}]' must be a text part ({{'type': "
                                            "'text', 'text': ...}); only text is supported")
            texts.append(part["text"])
        return "\n".join(texts)
    raise bad_param(param, f"'{param}' must be a string or a list of text parts")


def _token_entry(token: str, logprob: float) -> dict:
    return {"token": token, "logprob": clamp_logprob(logprob), "bytes": list(token.encode("utf-8"))}


def chat_logprobs(entries: Sequence[TokenLogprob]) -> dict:
    content = []
    for e in entries:
        item = _token_entry(e.token, e.logprob)
        item["top_logprobs"] = [_token_entry(t, v) for t, v in e.top.items()]
        content.append(item)
    return {"content": content}


class ChatShapes(ResponseShapes):
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

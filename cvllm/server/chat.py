"""``POST /v1/chat/completions``: the request's parsing and the response's shapes.

Called per HTTP request by the handlers (rank 0, event-loop thread); knows nothing of
aiohttp or the engine, so it is tested with plain dicts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Union

from cvllm.chat.tool_parsers import ToolCall, ToolCallDelta
from cvllm.outputs import TokenLogprob
from cvllm.sampling_params import StructuredOutputs
from cvllm.server.schemas.request_fields import SamplingFields
from cvllm.server.responses import ChoiceResult, ResponseShapes, clamp_logprob, usage
from cvllm.server.schemas.chat_body import ChatBody, enable_thinking
from cvllm.server.schemas.messages import CHAT_ROLES, ChatMessage, template_message
from cvllm.server.schemas.tools import resolve_tools
from cvllm.server.schemas.validation import validate_body

__all__ = ["AgentChoiceResult", "CHAT_ROLES", "ChatCompletionRequest", "ChatShapes",
           "chat_logprobs", "parse_chat_request"]


@dataclass
class ChatCompletionRequest:
    """A validated ``POST /v1/chat/completions`` body."""

    messages: List[dict]
    """Normalized messages for the chat template: ``content`` always a string, tool-call
    ``function.arguments`` a dict where the client's text is a JSON object."""
    model: Optional[str] = None
    stream: bool = False
    include_usage: bool = False
    max_tokens: Optional[int] = None
    """``max_completion_tokens`` if given, else ``max_tokens``; None means server default."""
    n: int = 1
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    chat_template_kwargs: Dict[str, Any] = field(default_factory=dict)
    """Extra template variables; holds ``enable_thinking`` when that was set."""
    sampling: SamplingFields = field(default_factory=SamplingFields)
    input_messages: List[ChatMessage] = field(default_factory=list)
    """The messages as validated, tool-call arguments as the client's text."""
    tools: Optional[List[Dict[str, Any]]] = None
    """Function tools as plain dicts (``{"type": "function", "function": {...}}``)."""
    tool_choice: Union[str, Dict[str, Any]] = "none"
    """'none', 'auto', 'required' or ``{"type": "function", "function": {"name": ...}}``."""
    parallel_tool_calls: bool = True
    structured_outputs: Optional[StructuredOutputs] = None
    """The output constraint from response_format / structured_outputs / guided_*."""
    response_format_name: Optional[str] = None
    enable_thinking: Optional[bool] = None
    """From ``chat_template_kwargs.enable_thinking``, else ``thinking``; None: not set."""

    @property
    def num_logprobs(self) -> Optional[int]:
        """``SamplingParams.logprobs``: top-k count per token, or None for no logprobs."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def named_tool(self) -> Optional[str]:
        """The function ``tool_choice`` forces, if it names one."""
        if isinstance(self.tool_choice, dict):
            return self.tool_choice["function"]["name"]
        return None


def parse_chat_request(body: dict) -> ChatCompletionRequest:
    """Validate a chat body; any mistake is an ``ApiError`` (400) naming the field."""
    parsed = validate_body(ChatBody, body, ChatBody.WHOLE_FIELDS)
    parsed.check_logprobs()
    tools = resolve_tools(parsed.tools, parsed.tool_choice)
    constraint = parsed.resolve_constraint()
    kwargs = parsed.template_kwargs()
    max_tokens = parsed.max_completion_tokens
    return ChatCompletionRequest(
        messages=[template_message(m) for m in parsed.messages],
        max_tokens=parsed.max_tokens if max_tokens is None else max_tokens,
        logprobs=bool(parsed.logprobs), top_logprobs=parsed.top_logprobs,
        chat_template_kwargs=kwargs, input_messages=list(parsed.messages),
        tools=tools.tools, tool_choice=tools.tool_choice,
        parallel_tool_calls=parsed.parallel_tool_calls is not False,
        structured_outputs=constraint.structured_outputs,
        response_format_name=constraint.response_format_name,
        enable_thinking=enable_thinking(kwargs), **parsed.common_values())


@dataclass
class AgentChoiceResult(ChoiceResult):
    """A choice of a request that went through the agent flow (``server/agent.py``):
    ``text`` is the content (None when empty), plus reasoning and tool calls."""

    reasoning_content: Optional[str] = None
    tool_calls: List[ToolCall] = field(default_factory=list)
    reasoning_tokens: int = 0


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

    def delta_chunk(self, index: int, content: Optional[str] = None,
                    reasoning: Optional[str] = None,
                    tool_calls: Sequence[ToolCallDelta] = (),
                    logprobs: Sequence[TokenLogprob] = ()) -> dict:
        """A chunk of the agent flow: only the delta's present parts are written."""
        delta: Dict[str, Any] = {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if content or (content is not None and logprobs):
            delta["content"] = content
        if tool_calls:
            delta["tool_calls"] = [tool_call_delta(d) for d in tool_calls]
        lp = chat_logprobs(logprobs) if self.want_logprobs and logprobs else None
        return self._chunk({"index": index, "delta": delta, "logprobs": lp,
                            "finish_reason": None})

    def agent_usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int,
                    reasoning_tokens: int) -> dict:
        body = usage(prompt_tokens, completion_tokens, cached_tokens)
        body["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
        return body

    def agent_usage_chunk(self, prompt_tokens: int, completion_tokens: int,
                          cached_tokens: int, reasoning_tokens: int) -> dict:
        chunk = self._envelope(self.chunk_object, [])
        chunk["usage"] = self.agent_usage(prompt_tokens, completion_tokens, cached_tokens,
                                          reasoning_tokens)
        return chunk

    def agent_response(self, choices: Sequence["AgentChoiceResult"], prompt_tokens: int,
                       cached_tokens: int) -> dict:
        """The non-streamed body of the agent flow; prompt tokens summed over its rounds."""
        body = self._envelope(self.object_name, [self._choice(c) for c in choices])
        body["usage"] = self.agent_usage(
            prompt_tokens, sum(c.num_output_tokens for c in choices), cached_tokens,
            sum(c.reasoning_tokens for c in choices))
        return body

    def _choice(self, c: ChoiceResult) -> dict:
        message: Dict[str, Any] = {"role": "assistant", "content": c.text}
        if isinstance(c, AgentChoiceResult):
            if c.reasoning_content is not None:
                message["reasoning_content"] = c.reasoning_content
            if c.tool_calls:
                message["tool_calls"] = [
                    {"id": t.id, "type": "function",
                     "function": {"name": t.name, "arguments": t.arguments}}
                    for t in c.tool_calls]
        return {"index": c.index, "message": message,
                "logprobs": chat_logprobs(c.logprobs) if self.want_logprobs else None,
                "finish_reason": c.finish_reason}


def tool_call_delta(d: ToolCallDelta) -> dict:
    """OpenAI's ``delta.tool_calls[i]``: id, type and name on a call's first delta."""
    out: Dict[str, Any] = {"index": d.index}
    function: Dict[str, Any] = {}
    if d.id is not None:
        out["id"] = d.id
        out["type"] = "function"
    if d.name is not None:
        function["name"] = d.name
    if d.arguments is not None or d.name is not None:
        function["arguments"] = d.arguments or ""
    out["function"] = function
    return out

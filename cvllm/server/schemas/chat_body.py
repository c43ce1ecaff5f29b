"""The ``POST /v1/chat/completions`` body as a pydantic model.

Built by ``chat.parse_chat_request`` once per HTTP request (rank 0, event-loop thread) and
dropped once the ``ChatCompletionRequest`` dataclass the handlers read is made from it.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

from pydantic import field_validator

from cvllm.server.schemas.request_fields import CommonFields, NonNegativeInt, PositiveInt
from cvllm.server.schemas.messages import ChatMessage
from cvllm.server.schemas.structured import ConstraintFields
from cvllm.server.schemas.tools import ToolChoice, ToolDefinition
from cvllm.server.schemas.validation import bad_param, invalid, list_of, show

# Arguments the engine's render_chat_prompt passes itself; a clash would be a TypeError (500).
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "bos_token", "eos_token"})

Messages = list_of(ChatMessage, min_length=1)
Tools = list_of(ToolDefinition)


class ChatBody(CommonFields, ConstraintFields):
    """A chat-completions body; ``chat.parse_chat_request`` adds the cross-field checks."""

    messages: Messages
    max_tokens: Optional[PositiveInt] = None
    max_completion_tokens: Optional[PositiveInt] = None
    logprobs: Optional[bool] = None
    top_logprobs: Optional[NonNegativeInt] = None
    chat_template_kwargs: Optional[Dict[str, Any]] = None
    tools: Optional[Tools] = None
    tool_choice: Optional[ToolChoice] = None
    parallel_tool_calls: Optional[bool] = None
    thinking: Optional[bool] = None
    """candle-vllm's switch for reasoning models; ``chat_template_kwargs.enable_thinking``
    wins when both are given, being the more specific."""
    # Accepted so OpenAI clients work, type-checked, and otherwise ignored.
    reasoning_effort: Optional[str] = None
    metadata: Optional[Dict[str, Any]] = None
    store: Optional[bool] = None
    service_tier: Optional[str] = None

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, value: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
        # By hand rather than Dict[str, str]: pydantic would report every bad value.
        for key, item in (value or {}).items():
            if not isinstance(item, str):
                raise invalid(f"must be a string, got {show(item)}", at=key)
        return value

    def check_logprobs(self) -> None:
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_param("top_logprobs", "'top_logprobs' requires 'logprobs' to be true")

    def template_kwargs(self) -> Dict[str, Any]:
        """``chat_template_kwargs`` without reserved names, plus ``enable_thinking`` when set
        (there or by ``thinking``); a null value counts as not given."""
        kwargs = {k: v for k, v in (self.chat_template_kwargs or {}).items()
                  if k not in RESERVED_TEMPLATE_KWARGS}
        explicit = kwargs.pop("enable_thinking", None)
        if explicit is not None and not isinstance(explicit, bool):
            raise bad_param("chat_template_kwargs.enable_thinking",
                            "'chat_template_kwargs.enable_thinking' must be a boolean, got "
                            f"{type(explicit).__name__}")
        enable = explicit if explicit is not None else self.thinking
        if enable is not None:
            kwargs["enable_thinking"] = enable
        return kwargs


def enable_thinking(kwargs: Dict[str, Any]) -> Optional[bool]:
    """The resolved switch, as ``ChatBody.template_kwargs`` left it."""
    value = kwargs.get("enable_thinking")
    return value if isinstance(value, bool) else None




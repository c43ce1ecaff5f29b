"""The ``POST /v1/completions`` body as a pydantic model.

Built by ``completions.parse_completion_request`` once per HTTP request (rank 0,
event-loop thread) and dropped once the ``CompletionRequest`` dataclass is made from it.
A prompt is one text or one list of token ids; batched prompts are refused.
"""

from __future__ import annotations

from typing import Any, ClassVar, List, Optional, Tuple, Union

from pydantic import field_validator

from cvllm.server.schemas.request_fields import CommonFields, NonNegativeInt, PositiveInt
from cvllm.server.schemas.structured import ConstraintFields
from cvllm.server.schemas.validation import invalid

_PROMPT_FORMS = ("must be a string, a list of one string, or a non-empty list of token ids")


def is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def parse_prompt(value: Any) -> Union[str, List[int]]:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        return parse_prompt(value[0])
    if isinstance(value, list) and value and all(is_token_id(t) for t in value):
        return list(value)
    if isinstance(value, list) and len(value) > 1 and all(isinstance(p, str) for p in value):
        raise invalid("holds several prompts; batched prompts are not supported, send one "
                      "prompt per request")
    raise invalid(_PROMPT_FORMS)


class CompletionBody(CommonFields, ConstraintFields):
    """A completions body (``echo`` is refused by ``parse_completion_request``)."""

    prompt: Any
    max_tokens: Optional[PositiveInt] = None
    logprobs: Optional[NonNegativeInt] = None
    echo: Optional[bool] = None

    WHOLE_FIELDS: ClassVar[Tuple[str, ...]] = CommonFields.WHOLE_FIELDS + ("prompt",)

    @field_validator("prompt", mode="plain")
    @classmethod
    def _prompt(cls, value: Any) -> Union[str, List[int]]:
        # The forms overlap (a list of one list of ids), so they are told apart by hand.
        return parse_prompt(value)

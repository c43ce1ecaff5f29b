"""The fields chat and completions share, as a pydantic model, and ``SamplingFields``.

``CommonFields`` is the base of both request bodies (``schemas/chat_body.py``,
``schemas/completion_body.py``); the parse functions call ``common_values`` once per HTTP
request (rank 0, event-loop thread). Types are checked here; value ranges of the sampling
fields are left to ``SamplingParams.validate`` so there is one source of truth for them.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Annotated, Any, ClassVar, Dict, List, Optional, Tuple

from pydantic import Field, Tag

from cvllm.server.schemas.validation import StrictModel, bad_param, json_union, list_of

__all__ = ["CommonFields", "SamplingFields", "StreamOptions", "TokenId", "bad_param"]

TokenId = Annotated[int, Field(ge=0)]
PositiveInt = Annotated[int, Field(ge=1)]
NonNegativeInt = Annotated[int, Field(ge=0)]
TokenIds = list_of(TokenId)

StopField = json_union("must be a string or a list of strings",
                       Annotated[str, Tag("<str>")], Annotated[list_of(str), Tag("<list>")])


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


class StreamOptions(StrictModel):
    include_usage: Optional[bool] = None


class CommonFields(StrictModel):
    """Fields of both generation bodies: model, streaming, n and the sampling values."""

    model: Optional[str] = None
    stream: Optional[bool] = None
    stream_options: Optional[StreamOptions] = None
    n: Optional[PositiveInt] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None
    seed: Optional[int] = None
    min_tokens: Optional[int] = None
    stop: Optional[StopField] = None
    stop_token_ids: Optional[TokenIds] = None
    ignore_eos: Optional[bool] = None
    skip_special_tokens: Optional[bool] = None
    user: Optional[str] = None
    """Accepted and ignored (OpenAI's end-user id)."""

    # Errors inside these are reported on the field itself, as the API always did.
    WHOLE_FIELDS: ClassVar[Tuple[str, ...]] = ("stop", "stop_token_ids")

    def sampling_fields(self) -> SamplingFields:
        values = {f.name: getattr(self, f.name) for f in fields(SamplingFields)}
        if isinstance(self.stop, str):
            values["stop"] = [self.stop]
        return SamplingFields(**values)

    def common_values(self) -> Dict[str, Any]:
        """Keyword arguments both request dataclasses take."""
        include_usage = bool(self.stream_options and self.stream_options.include_usage)
        return dict(model=self.model, stream=bool(self.stream), include_usage=include_usage,
                    n=1 if self.n is None else self.n, sampling=self.sampling_fields())

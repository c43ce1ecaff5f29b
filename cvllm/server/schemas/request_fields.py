"""The fields chat and completions share, as pydantic models: ``CommonFields``, of which
``SamplingFields`` is the sampling part.

``CommonFields`` is the base of both request bodies (``schemas/chat_body.py``,
``schemas/completion_body.py``); the parse functions call ``common_values`` once per HTTP
request (rank 0, event-loop thread), which hands the request dataclasses their
``SamplingFields``. Types are checked here; value ranges of the sampling fields are left to
``SamplingParams.validate`` so there is one source of truth for them.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Dict, Optional, Tuple

from pydantic import Field, Tag

from cvllm.server.schemas.validation import StrictModel, bad_param, json_union, list_of

__all__ = ["CommonFields", "SamplingFields", "StreamOptions", "TokenId", "bad_param"]

TokenId = Annotated[int, Field(ge=0)]
PositiveInt = Annotated[int, Field(ge=1)]
NonNegativeInt = Annotated[int, Field(ge=0)]
TokenIds = list_of(TokenId)

StopField = json_union("must be a string or a list of strings",
                       Annotated[str, Tag("<str>")], Annotated[list_of(str), Tag("<list>")])


class SamplingFields(StrictModel):
    """The sampling values of a body. As a request keeps them (``CommonFields.
    sampling_fields``): the values a client set explicitly, None meaning "use the server
    default", and ``stop`` a list."""

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

    def overrides(self) -> Dict[str, Any]:
        """The fields the client set, keyed like ``SamplingParams``."""
        values = ((name, getattr(self, name)) for name in SamplingFields.model_fields)
        return {name: value for name, value in values if value is not None}


class StreamOptions(StrictModel):
    include_usage: Optional[bool] = None


class _HeadFields(StrictModel):
    model: Optional[str] = None
    stream: Optional[bool] = None
    stream_options: Optional[StreamOptions] = None
    n: Optional[PositiveInt] = None


class CommonFields(SamplingFields, _HeadFields):
    """Fields of both generation bodies: model, streaming, n and the sampling values.

    pydantic orders fields base by base from the last base (``_HeadFields``) on, so the
    body's fields are checked, and its first error found, in the order of the API
    reference: model, stream, stream_options, n, the sampling values, user."""

    user: Optional[str] = None
    """Accepted and ignored (OpenAI's end-user id)."""

    # Errors inside these are reported on the field itself, as the API always did.
    WHOLE_FIELDS: ClassVar[Tuple[str, ...]] = ("stop", "stop_token_ids")

    def sampling_fields(self) -> SamplingFields:
        values = {name: getattr(self, name) for name in SamplingFields.model_fields}
        if isinstance(self.stop, str):
            values["stop"] = [self.stop]
        return SamplingFields.model_construct(**values)  # checked already, as part of self

    def common_values(self) -> Dict[str, Any]:
        """Keyword arguments both request dataclasses take."""
        include_usage = bool(self.stream_options and self.stream_options.include_usage)
        return dict(model=self.model, stream=bool(self.stream), include_usage=include_usage,
                    n=1 if self.n is None else self.n, sampling=self.sampling_fields())

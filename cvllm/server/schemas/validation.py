"""From a request body to a pydantic model, and from a ``ValidationError`` to a 400.

Used by every schema module and by the parse functions (rank 0, event-loop thread, once
per HTTP request). The OpenAI error shape names one field, so only the first pydantic error
is answered: ``param`` is its dotted path (``tools[0].function.name``) and the message is a
sentence written here, never pydantic's own dump (which embeds URLs and whole inputs).

Strictness matches the API's JSON types: every model is ``strict`` (``true`` is not a
number, ``1.0`` is not an integer, ``"1"`` is neither), unknown keys are ignored, and a
field given as ``null`` is the same as a field left out.
"""

from __future__ import annotations

import re
from typing import (Annotated, Any, Collection, Dict, List, Optional, Sequence, Tuple, Type,
                    TypeVar, Union)

from pydantic import AfterValidator, BaseModel, ConfigDict, Discriminator, Field, ValidationError
from pydantic_core import PydanticCustomError

from cvllm.server.errors import ApiError

CUSTOM_ERROR = "cvllm_invalid"
"""pydantic error type of the checks written here; its ``ctx`` carries the phrase."""

M = TypeVar("M", bound=BaseModel)


class StrictModel(BaseModel):
    """Base of every request schema: JSON types only, unknown keys ignored."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


def bad_param(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param)


def invalid(phrase: str, at: Optional[str] = None) -> PydanticCustomError:
    """An error for a validator to raise: ``'<param>' <phrase>``.

    ``at`` names a sub-field (``"content"``) when a model-level check blames one field,
    since pydantic locates a model validator's error at the model itself.
    """
    ctx: Dict[str, Any] = {"phrase": phrase}
    if at is not None:
        ctx["at"] = at
    return PydanticCustomError(CUSTOM_ERROR, "{phrase}", ctx)


# Tags of the unions the schemas discriminate by hand (``json_union``, response_format);
# pydantic puts the chosen tag into an error's location, and the client must not see it.
UNION_TAGS = frozenset({"<str>", "<list>", "<object>", "<text>", "<json_object>",
                        "<json_schema>"})


def json_kind(value: Any) -> Optional[str]:
    """Discriminator for unions of JSON kinds: the tag of ``value``'s JSON type, or None."""
    if isinstance(value, str):
        return "<str>"
    if isinstance(value, list):
        return "<list>"
    if isinstance(value, dict):
        return "<object>"
    return None


def json_union(phrase: str, *members: Any) -> Any:
    """A union of ``Annotated[T, Tag("<kind>")]`` members picked by the value's JSON kind.

    Picking by kind (rather than trying each member) keeps the error of a bad value at
    the path the client wrote, and a value of no listed kind fails with ``phrase`` (no
    braces in it: pydantic formats it).
    """
    return Annotated[Union[members], Discriminator(  # type: ignore[valid-type]
        json_kind, custom_error_type=CUSTOM_ERROR, custom_error_message=phrase)]


def list_of(item: Any, min_length: Optional[int] = None) -> Any:
    """``List[item]`` that stops at its first bad element: a body of a million bad items
    must not cost a million error objects (seconds of the event loop)."""
    return Annotated[List[item], Field(fail_fast=True, min_length=min_length)]


def name_matching(pattern: str, phrase: str) -> Any:
    """``str`` that must match ``pattern`` in full (a tool or format name); else the error
    is ``'<param>' <phrase>``."""
    compiled = re.compile(pattern)

    def check(name: str) -> str:
        if not compiled.fullmatch(name):
            raise invalid(phrase)
        return name

    return Annotated[str, AfterValidator(check)]


def validate_body(model: Type[M], body: Any, whole_fields: Collection[str] = ()) -> M:
    """``model.model_validate(body)``, or the ``ApiError`` (400) of its first error.

    ``whole_fields``: top-level fields whose errors are reported on the field itself
    rather than on an element of it (``stop``, not ``stop[3]``), as the API always did.
    """
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        raise api_error(first, whole_fields) from None


def api_error(error: Dict[str, Any], whole_fields: Collection[str] = ()) -> ApiError:
    """The 400 for one pydantic error dict."""
    loc = [part for part in error["loc"] if part not in UNION_TAGS]
    ctx = error.get("ctx") or {}
    if error["type"] == CUSTOM_ERROR and ctx.get("at"):
        loc.append(ctx["at"])
    where = param_path(loc)  # the message names the element, ``param`` the whole field
    param = param_path(loc[:1]) if loc and loc[0] in whole_fields else where
    return bad_param(param or None, f"'{where or 'body'}' {describe(error)}")


def param_path(loc: Sequence[Any]) -> str:
    """``("tools", 0, "function", "name")`` -> ``"tools[0].function.name"``.

    A key holding a lone surrogate is shown escaped, so the path can be encoded in the
    response (the same way ``request_body`` names such keys).
    """
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out.encode("utf-8", "backslashreplace").decode("utf-8")


_TYPE_PHRASES = {
    "int_type": "must be an integer", "int_from_float": "must be an integer",
    "int_parsing": "must be an integer", "float_type": "must be a number",
    "float_parsing": "must be a number", "finite_number": "must be a finite number",
    "bool_type": "must be a boolean", "bool_parsing": "must be a boolean",
    "string_type": "must be a string", "string_unicode": "must be valid Unicode text",
    "list_type": "must be a list", "dict_type": "must be an object",
    "model_type": "must be an object", "model_attributes_type": "must be an object",
}
_BOUND_PHRASES = {
    "greater_than_equal": "must be >= {ge}", "greater_than": "must be > {gt}",
    "less_than_equal": "must be <= {le}", "less_than": "must be < {lt}",
    "literal_error": "must be one of {expected}",
    "too_long": "must have at most {max_length} items",
    "string_too_long": "must be at most {max_length} characters long",
    "string_pattern_mismatch": "must match the pattern {pattern}",
}


def describe(error: Dict[str, Any]) -> str:
    """The sentence after ``'<param>'`` for one pydantic error."""
    kind, ctx = error["type"], error.get("ctx") or {}
    if kind == CUSTOM_ERROR:  # a discriminator's error has its phrase as the message
        return str(ctx.get("phrase", error.get("msg")))
    if kind == "missing":
        return "is required"
    if kind in ("too_short", "string_too_short"):
        if ctx.get("min_length") == 1:
            return "must not be empty"
        noun = "items" if kind == "too_short" else "characters"
        return f"must have at least {ctx.get('min_length')} {noun}"
    if kind in _TYPE_PHRASES:
        return f"{_TYPE_PHRASES[kind]}, got {show(error.get('input'))}"
    if kind in _BOUND_PHRASES:
        return f"{_BOUND_PHRASES[kind].format(**ctx)}, got {show(error.get('input'))}"
    return f"is invalid: {error.get('msg', kind)}"


def show(value: Any, limit: int = 60) -> str:
    """A short repr of a client's value for an error message (repr escapes surrogates)."""
    if isinstance(value, (dict, list)):  # never echo a whole structure
        return "an object" if isinstance(value, dict) else "a list"
    try:
        text = repr(value)
    except ValueError:  # an int past Python's digit limit for str()
        return "a very large number"
    return text if len(text) <= limit else text[:limit] + "..."


def first_duplicate(names: List[str]) -> Optional[Tuple[int, int]]:
    """(first index, duplicate index) of the first repeated name, or None."""
    seen: Dict[str, int] = {}
    for i, name in enumerate(names):
        if name in seen:
            return seen[name], i
        seen[name] = i
    return None

"""Output constraints of a request: ``response_format``, vLLM's ``structured_outputs`` and
its older ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``.

Validated as part of both request bodies (``ConstraintFields``) once per HTTP request (rank
0, event-loop thread) and normalized into ``cvllm.sampling_params.StructuredOutputs``,
which the engine compiles. A request has at most one constraint source. Only what Python
can check is checked here (schema validity, ``re`` syntax); the grammar engine may still
refuse a pattern later, which is answered where it compiles.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Annotated, Any, Dict, List, Literal, Optional, Tuple, Union

from pydantic import AfterValidator, Discriminator, Field, Tag, model_validator

from cvllm.sampling_params import StructuredOutputs
from cvllm.server.schemas.json_schema import JsonSchemaObject, canonical_json, check_json_schema
from cvllm.server.schemas.validation import (CUSTOM_ERROR, StrictModel, bad_param, invalid,
                                             json_union, list_of, name_matching)

ANY_OBJECT_SCHEMA: Dict[str, Any] = {"type": "object"}
"""The schema of a ``json_schema`` response format that gives none: any JSON object."""


def _schema_value(value: Union[Dict[str, Any], str]) -> Dict[str, Any]:
    if isinstance(value, str):  # vLLM takes the schema as JSON text too
        try:
            value = json.loads(value)
        except (ValueError, RecursionError):
            raise invalid("must be a JSON Schema object or its JSON text; the text is not "
                          "valid JSON") from None
        if not isinstance(value, dict):
            raise invalid("must be a JSON Schema object or its JSON text")
    check_json_schema(value)
    return value


def _regex(pattern: str) -> str:
    try:
        re.compile(pattern)
    except (re.error, OverflowError, RecursionError, ValueError) as exc:
        raise invalid(f"is not a valid regular expression: {exc}") from None
    return pattern


JsonSchemaValue = Annotated[
    json_union("must be a JSON Schema object or its JSON text",
               Annotated[Dict[str, Any], Tag("<object>")], Annotated[str, Tag("<str>")]),
    AfterValidator(_schema_value)]
Regex = Annotated[str, AfterValidator(_regex)]
Choices = list_of(Annotated[str, Field(min_length=1)], min_length=1)
Grammar = Annotated[str, Field(min_length=1)]
FormatName = name_matching(r"[A-Za-z0-9_-]{1,64}",
                           "must be 1 to 64 characters, each a letter, digit, '_' or '-'")


class JsonSchemaFormat(StrictModel):
    name: FormatName
    description: Optional[str] = None
    schema_: Optional[JsonSchemaObject] = Field(None, alias="schema")
    strict: Optional[bool] = None


class TextFormat(StrictModel):
    type: Literal["text"]


class JsonObjectFormat(StrictModel):
    type: Literal["json_object"]


class JsonSchemaResponseFormat(StrictModel):
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


_FORMAT_TYPES = ("text", "json_object", "json_schema")


def _format_kind(value: Any) -> Optional[str]:
    kind = value.get("type") if isinstance(value, dict) else None
    return f"<{kind}>" if isinstance(kind, str) and kind in _FORMAT_TYPES else None


ResponseFormat = Annotated[
    Union[Annotated[TextFormat, Tag("<text>")], Annotated[JsonObjectFormat, Tag("<json_object>")],
          Annotated[JsonSchemaResponseFormat, Tag("<json_schema>")]],
    Discriminator(_format_kind, custom_error_type=CUSTOM_ERROR,
                  custom_error_message="must be an object whose 'type' is 'text', "
                                       "'json_object' or 'json_schema'")]


class StructuredOutputsBody(StrictModel):
    """vLLM's ``structured_outputs``: exactly one constraint."""

    json_: Optional[JsonSchemaValue] = Field(None, alias="json")
    regex: Optional[Regex] = None
    choice: Optional[Choices] = None
    grammar: Optional[Grammar] = None
    json_object: Optional[bool] = None

    @model_validator(mode="after")
    def _exactly_one(self) -> "StructuredOutputsBody":
        given = [self.json_, self.regex, self.choice, self.grammar, self.json_object or None]
        if sum(v is not None for v in given) != 1:
            raise invalid("must set exactly one of 'json', 'regex', 'choice', 'grammar' or "
                          "'json_object'")
        return self

    def constraint(self) -> StructuredOutputs:
        if self.json_ is not None:
            return StructuredOutputs("json_schema", canonical_json(self.json_))
        if self.regex is not None:
            return StructuredOutputs("regex", self.regex)
        if self.choice is not None:
            return StructuredOutputs("choice", json.dumps(self.choice, ensure_ascii=False))
        if self.grammar is not None:
            return StructuredOutputs("grammar", self.grammar)
        return StructuredOutputs("json_object")


@dataclass
class ResolvedConstraint:
    """What the request object exposes of the constraint fields."""

    structured_outputs: Optional[StructuredOutputs] = None
    response_format_name: Optional[str] = None
    """``response_format.json_schema.name`` when the constraint came from there."""


class ConstraintFields(StrictModel):
    """The constraint fields both generation bodies accept."""

    response_format: Optional[ResponseFormat] = None
    structured_outputs: Optional[StructuredOutputsBody] = None
    guided_json: Optional[JsonSchemaValue] = None
    guided_regex: Optional[Regex] = None
    guided_choice: Optional[Choices] = None
    guided_grammar: Optional[Grammar] = None

    def resolve_constraint(self) -> ResolvedConstraint:
        """The one constraint of the request; two sources are a 400 naming the second."""
        sources = self._constraint_sources()
        if len(sources) > 1:
            (first, _), (second, _) = sources[:2]
            raise bad_param(second, f"'{second}' and '{first}' both constrain the output; "
                                    "send at most one of response_format (json_object or "
                                    "json_schema), structured_outputs and guided_*")
        if not sources:
            return ResolvedConstraint()
        fmt = self.response_format
        name = (fmt.json_schema.name if isinstance(fmt, JsonSchemaResponseFormat) else None)
        return ResolvedConstraint(sources[0][1], name)

    def _constraint_sources(self) -> List[Tuple[str, StructuredOutputs]]:
        out: List[Tuple[str, StructuredOutputs]] = []
        fmt = self.response_format
        if isinstance(fmt, JsonObjectFormat):
            out.append(("response_format", StructuredOutputs("json_object")))
        elif isinstance(fmt, JsonSchemaResponseFormat):
            schema = fmt.json_schema.schema_
            text = canonical_json(ANY_OBJECT_SCHEMA if schema is None else schema)
            out.append(("response_format", StructuredOutputs("json_schema", text)))
        if self.structured_outputs is not None:
            out.append(("structured_outputs", self.structured_outputs.constraint()))
        if self.guided_json is not None:
            out.append(("guided_json",
                        StructuredOutputs("json_schema", canonical_json(self.guided_json))))
        if self.guided_regex is not None:
            out.append(("guided_regex", StructuredOutputs("regex", self.guided_regex)))
        if self.guided_choice is not None:
            out.append(("guided_choice", StructuredOutputs(
                "choice", json.dumps(self.guided_choice, ensure_ascii=False))))
        if self.guided_grammar is not None:
            out.append(("guided_grammar", StructuredOutputs("grammar", self.guided_grammar)))
        return out

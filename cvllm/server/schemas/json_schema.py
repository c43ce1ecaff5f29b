"""Checking that a client's JSON Schema is one (tool parameters, ``response_format``,
``structured_outputs.json``, ``guided_json``), and its canonical text; ``JsonSchemaObject``
is the field type of a schema given as an object.

Called from validators of ``tools`` and ``structured`` once per schema in a request (rank 0,
event-loop thread). Checking against the 2020-12 metaschema costs about half a millisecond
per small schema, and an agent sends the same tools every turn, so the verdict is cached by
the schema's canonical text (only for schemas up to ``CACHE_MAX_CHARS``, so the cache holds
at most ``CACHE_SIZE * CACHE_MAX_CHARS`` characters).
"""

from __future__ import annotations

import functools
import json
from typing import Annotated, Any, Dict, Optional

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError
from pydantic import AfterValidator

from cvllm.server.schemas.validation import invalid

CACHE_SIZE = 256
CACHE_MAX_CHARS = 64 * 1024
_MAX_PROBLEM_CHARS = 200


def canonical_json(value: Any) -> str:
    """Compact, in the client's key order: equal schemas sent alike give equal text (the
    constraint cache key). Keys are not sorted: the grammar emits an object's properties
    in the order the schema declares them, and sorting would reorder the output."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def check_json_schema(schema: Dict[str, Any]) -> str:
    """The schema's canonical text, or a validator error naming the problem."""
    try:
        text = canonical_json(schema)
    except (ValueError, TypeError, RecursionError):
        # Only nesting deeper than the recursion limit gets here: the body was JSON.
        raise invalid("is nested too deeply to be a usable JSON Schema") from None
    problem = _cached_problem(text) if len(text) <= CACHE_MAX_CHARS else _problem(schema)
    if problem is not None:
        raise invalid(f"is not a valid JSON Schema: {problem}")
    return text


def checked_schema(schema: Dict[str, Any]) -> Dict[str, Any]:
    """``schema`` itself once ``check_json_schema`` accepts it (a field validator)."""
    check_json_schema(schema)
    return schema


JsonSchemaObject = Annotated[Dict[str, Any], AfterValidator(checked_schema)]
"""A field holding a JSON Schema object, checked as one."""


@functools.lru_cache(maxsize=CACHE_SIZE)
def _cached_problem(text: str) -> Optional[str]:
    return _problem(json.loads(text))


def _problem(schema: Any) -> Optional[str]:
    """None for a valid 2020-12 schema, else a short description of the first problem."""
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as exc:
        message = exc.message
        if len(message) > _MAX_PROBLEM_CHARS:  # it embeds the offending value
            message = message[:_MAX_PROBLEM_CHARS] + "..."
        return f"{message} (at {exc.json_path})"
    except RecursionError:
        return "it is nested too deeply"
    return None

"""``tools``, ``tool_choice`` and ``parallel_tool_calls`` of a chat-completions body.

Validated by ``chat_body.ChatBody`` once per HTTP request (rank 0, event-loop thread);
``resolve_tools`` checks them against each other and gives the plain dicts the chat template
and the tool parsers take. Only function tools exist in the API.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Dict, List, Literal, Optional, Union

from pydantic import Tag

from cvllm.server.schemas.json_schema import JsonSchemaObject
from cvllm.server.schemas.validation import (StrictModel, bad_param, first_duplicate, json_union,
                                             name_matching, show)

TOOL_CHOICE_MODES = ("none", "auto", "required")
ToolName = name_matching(r"[A-Za-z0-9_.-]{1,64}",
                         "must be 1 to 64 characters, each a letter, digit, '_', '.' or '-'")


class FunctionDefinition(StrictModel):
    name: ToolName
    description: Optional[str] = None
    parameters: Optional[JsonSchemaObject] = None
    """A JSON Schema of the arguments object."""
    strict: Optional[bool] = None


class ToolDefinition(StrictModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ToolChoiceFunction(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"] = "function"
    function: ToolChoiceFunction


ToolChoice = json_union(
    "must be 'none', 'auto', 'required' or an object naming a function",
    Annotated[Literal["none", "auto", "required"], Tag("<str>")],
    Annotated[NamedToolChoice, Tag("<object>")])


@dataclass
class ResolvedTools:
    """What the request object exposes of the tool fields."""

    tools: Optional[List[Dict[str, Any]]]
    """The tools as plain dicts (None when none were given)."""
    tool_choice: Union[str, Dict[str, Any]]
    """'none', 'auto', 'required', or ``{"type": "function", "function": {"name": ...}}``."""


def resolve_tools(tools: Optional[List[ToolDefinition]],
                  choice: Union[str, NamedToolChoice, None]) -> ResolvedTools:
    """Check the tools against each other and ``tool_choice``; 400 (ApiError) otherwise.

    The default choice is 'auto' when tools are given, else 'none', as OpenAI's.
    """
    tools = tools or None
    names = [t.function.name for t in tools or ()]
    dup = first_duplicate(names)
    if dup is not None:
        first, again = dup
        param = f"tools[{again}].function.name"
        raise bad_param(param, f"'{param}' repeats the tool name {show(names[again])} of "
                               f"tools[{first}]; tool names must be unique")
    if choice is None:
        choice = "auto" if tools else "none"
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in names:
            raise bad_param("tool_choice.function.name",
                            f"'tool_choice.function.name' names {show(name)}, which is not among "
                            f"'tools'" + ("" if tools else " (no tools were given)"))
        choice_out: Union[str, Dict[str, Any]] = choice.model_dump()
    else:
        if choice == "required" and not tools:
            raise bad_param("tool_choice", "'tool_choice' is 'required' but no 'tools' were "
                                           "given")
        choice_out = choice
    dicts = [t.model_dump(exclude_none=True) for t in tools] if tools else None
    return ResolvedTools(tools=dicts, tool_choice=choice_out)

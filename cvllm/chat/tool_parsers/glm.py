"""The GLM-4.5 / GLM-4.7 format:
``<tool_call>NAME\\n<arg_key>k</arg_key>\\n<arg_value>v</arg_value>\\n...</tool_call>``
(GLM-4.7 may put ``<arg_key>`` right after the name, without the newline).

Values are text typed by the tool's schema (``arguments.convert_value``); string values
stream as they arrive. Built by the server per request choice (see base.py); pure
Python, server side.
"""

from typing import Optional

from cvllm.chat.tool_parsers.base import ToolParser
from cvllm.chat.tool_parsers.blocks import (
    FAIL, BlockProgress, TextArgsReader, match_any, match_literal, read_name, skip_ws)

_NAME, _ARGS, _VALUE_OPEN = range(3)
_CLOSE = "</tool_call>"


class GlmBlock(TextArgsReader):
    """One ``<tool_call>`` block: a name, then key/value pairs."""

    def __init__(self, tools, start: int, body: int):
        super().__init__(tools, start, body, _NAME)
        self.key = ""

    def _markup_step(self, text: str, final: bool) -> Optional[BlockProgress]:
        if self.phase == _NAME:
            end, after, name = read_name(text, skip_ws(text, self.pos),
                                         ("\n", "<arg_key>", _CLOSE), final)
            if end < 0 or not self.tools.accepts(name):
                return self.status_of(end if end < 0 else FAIL, final)
            self.open_call(name)
            self.pos, self.phase = (after if text[end] == "\n" else end), _ARGS
        elif self.phase == _ARGS:
            at, tag = match_any(text, skip_ws(text, self.pos), ("<arg_key>", _CLOSE), final)
            if at < 0:
                return self.status_of(at, final)
            if tag == _CLOSE:
                self.args.close()
                return self.done(at)
            end, after, key = read_name(text, at, ("</arg_key>",), final)
            if end < 0 or not key:
                return self.status_of(end if end < 0 else FAIL, final)
            self.key, self.pos, self.phase = key, after, _VALUE_OPEN
        else:
            at = match_literal(text, skip_ws(text, self.pos), "<arg_value>", final)
            if at < 0:
                return self.status_of(at, final)
            self.open_value(self.key, at, "</arg_value>", trim_newlines=False)
            self.phase = _ARGS
        return None


class Glm45ToolParser(ToolParser):
    name = "glm45"
    needs_special_tokens = True   # GLM's <tool_call>, <arg_key>, ... are special tokens
    markers = ("<tool_call>",)
    block_reader = GlmBlock

"""The qwen3_coder format (Qwen3-Coder): XML-style calls whose parameter values are text,
``<tool_call>\\n<function=NAME>\\n<parameter=P>\\nvalue\\n</parameter>\\n...``
``</function>\\n</tool_call>``.

Values are typed by the tool's schema (``arguments.convert_value``); string values stream
as they are generated, less the one newline the template puts on each side. Built by
the server per request choice (see base.py); pure Python, server side.
"""

from typing import Optional

from cvllm.chat.tool_parsers.base import ToolParser
from cvllm.chat.tool_parsers.blocks import (
    FAIL, BlockProgress, TextArgsReader, match_any, match_literal, read_name, skip_ws)

_FUNCTION, _PARAMS, _CLOSE = range(3)


class Qwen3CoderBlock(TextArgsReader):
    """One ``<tool_call>`` block holding one ``<function=...>``."""

    def __init__(self, tools, start: int, body: int):
        super().__init__(tools, start, body, _FUNCTION)

    def _markup_step(self, text: str, final: bool) -> Optional[BlockProgress]:
        """Move one phase on; a progress to return when it cannot."""
        if self.phase == _CLOSE:
            return self.expect_end(text, final, "</tool_call>")
        if self.phase == _FUNCTION:
            at = match_literal(text, skip_ws(text, self.pos), "<function=", final)
            if at < 0:
                return self.status_of(at, final)
            end, after, name = read_name(text, at, (">",), final)
            if end < 0 or not self.tools.accepts(name):
                return self.status_of(end if end < 0 else FAIL, final)
            self.open_call(name)
            self.pos, self.phase = after, _PARAMS
        else:
            at, tag = match_any(text, skip_ws(text, self.pos), ("<parameter=", "</function>"),
                                final)
            if at < 0:
                return self.status_of(at, final)
            if tag == "</function>":
                self.args.close()
                self.pos, self.phase = at, _CLOSE
                return None
            end, after, key = read_name(text, at, (">",), final)
            if end < 0 or not key:
                return self.status_of(end if end < 0 else FAIL, final)
            self.open_value(key, after, "</parameter>", trim_newlines=True)
        return None


class Qwen3CoderToolParser(ToolParser):
    name = "qwen3_coder"
    needs_special_tokens = False
    markers = ("<tool_call>",)
    block_reader = Qwen3CoderBlock

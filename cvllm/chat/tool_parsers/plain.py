"""Parsers without markers: ``json``, a fallback for models that answer a call as plain
JSON, and ``passthrough``, which never finds a call.

``json``: the whole answer (after whitespace, optionally inside one ```json fence) is a
call object ``{"name", "arguments" | "parameters"}`` or a list of them; anything but
whitespace after it makes it content. Built by the server per request choice (see
base.py); pure Python, server side.
"""

from typing import Optional

from cvllm.chat.tool_parsers.base import FENCE, UNDECIDED, StartBlock, ToolParser
from cvllm.chat.tool_parsers.blocks import (
    BlockProgress, PhasedReader, match_any, match_literal, skip_ws)
from cvllm.chat.tool_parsers.json_calls import JsonCalls, read_json

_OPEN, _JSON, _CLOSE_FENCE, _TRAIL = range(4)


class JsonAnswerBlock(PhasedReader):
    """The whole rest of the output: [fence] calls [fence] whitespace."""

    def __init__(self, tools, start: int):
        super().__init__(tools, start, start)
        self.phase = _OPEN
        self.fenced = False
        self.json: Optional[JsonCalls] = None

    def _step(self, text: str, final: bool) -> Optional[BlockProgress]:
        if self.phase == _OPEN:
            if text.startswith(FENCE, self.pos):
                after, _ = match_any(text, self.pos, (FENCE + "json", FENCE + "\n"), final)
                if after < 0:
                    return self.status_of(after, final)
                self.fenced, self.pos = True, after
            self.json = JsonCalls(self.tools, self.pos, self.calls, allow_list=True,
                                  require_args=True)
            self.phase = _JSON
        elif self.phase == _JSON:
            progress = read_json(self, self.json, text, final)
            if progress is not None:
                return progress
            self.pos, self.phase = self.json.end, _CLOSE_FENCE if self.fenced else _TRAIL
        elif self.phase == _CLOSE_FENCE:
            after = match_literal(text, skip_ws(text, self.pos), FENCE, final)
            if after < 0:
                return self.status_of(after, final)
            self.pos, self.phase = after, _TRAIL
        else:
            at = skip_ws(text, self.pos)
            if at < len(text):
                return self.broken()
            return self.done(at) if final else self.pending()
        return None


class JsonToolParser(ToolParser):
    name = "json"
    needs_special_tokens = False

    def _output_start(self, text: str, pos: int, final: bool) -> StartBlock:
        if text[pos] in "{[" or text.startswith(FENCE, pos):
            return JsonAnswerBlock(self.tools, pos), pos
        if not final and FENCE.startswith(text[pos:]):
            return UNDECIDED
        return None


class PassthroughToolParser(ToolParser):
    """All text is content (under the same whitespace rule as every parser)."""

    name = "passthrough"
    needs_special_tokens = False

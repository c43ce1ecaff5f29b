"""The DeepSeek V3 / V3.1 format, between ``<｜tool▁calls▁begin｜>`` and ``<｜tool▁calls▁end｜>``:

  V3:   ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>``
  V3.1: ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>``

told apart per call by what follows the separator (an object: V3.1). Built by the
server per request choice (see base.py); pure Python, server side.
"""

from typing import Optional

from cvllm.chat.tool_parsers.base import FENCE, ToolParser
from cvllm.chat.tool_parsers.blocks import (
    NEED, BlockProgress, PartialCall, PhasedReader, match_any, match_literal, read_name,
    skip_ws)
from cvllm.chat.tool_parsers.json_calls import JsonArgs, read_json

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"

_LIST, _HEAD, _AFTER_SEP, _V3_NAME, _V3_FENCE, _ARGS, _ARGS_FENCE, _CALL_END = range(8)


class DeepSeekBlock(PhasedReader):
    """The calls of one ``<｜tool▁calls▁begin｜>`` block, each in either layout."""

    def __init__(self, tools, start: int, body: int):
        super().__init__(tools, start, body)
        self.phase = _LIST
        self.head = ""
        self.fenced = False
        self.args: Optional[JsonArgs] = None

    def _announce(self, name: str, at: int) -> Optional[BlockProgress]:
        if not self.tools.accepts(name):
            return self.broken()
        self.calls.append(PartialCall(name))
        self.pos = at
        return None

    def _step(self, text: str, final: bool) -> Optional[BlockProgress]:
        phase, at = self.phase, skip_ws(text, self.pos)
        if phase == _LIST:
            after, tag = match_any(text, at, (CALL_BEGIN, CALLS_END), final)
            if after < 0:
                return self.status_of(after, final)
            if tag == CALLS_END:
                return self.done(after)
            self.pos, self.phase = after, _HEAD
        elif phase == _HEAD:
            end, after, self.head = read_name(text, at, (SEP,), final)
            if end < 0:
                return self.status_of(end, final)
            self.pos, self.phase = after, _AFTER_SEP
        elif phase == _AFTER_SEP:
            return self._after_separator(text, at, final)
        elif phase == _V3_NAME:
            return self._v3_name(text, at, final)
        elif phase == _V3_FENCE:
            return self._fence_open(text, at, final)
        elif phase == _ARGS:
            return self._arguments(text, at, final)
        elif phase == _ARGS_FENCE:
            after = match_literal(text, at, FENCE, final)
            if after < 0:
                return self.status_of(after, final)
            self.pos, self.phase = after, _CALL_END
        else:
            after = match_literal(text, at, CALL_END, final)
            if after < 0:
                return self.status_of(after, final)
            self.pos, self.phase = after, _LIST
        return None

    def _after_separator(self, text: str, at: int, final: bool) -> Optional[BlockProgress]:
        """An object after the separator is V3.1's arguments (the head was the name);
        anything else is V3's name, after its ``function`` head."""
        if at == len(text):
            return self.status_of(NEED, final)
        if text[at] != "{":
            self.phase = _V3_NAME
            return None
        self.phase = _ARGS
        return self._announce(self.head, at)

    def _v3_name(self, text: str, at: int, final: bool) -> Optional[BlockProgress]:
        end, _, name = read_name(text, at, ("\n", FENCE, "{"), final)
        if end < 0:
            return self.status_of(end, final)
        self.phase = _V3_FENCE
        return self._announce(name, end)

    def _arguments(self, text: str, at: int, final: bool) -> Optional[BlockProgress]:
        if self.args is None:
            self.args = JsonArgs(at, self.calls[-1])
        progress = read_json(self, self.args, text, final)
        if progress is not None:
            return progress
        self.pos, self.args = self.args.end, None
        self.phase = _ARGS_FENCE if self.fenced else _CALL_END
        return None

    def _fence_open(self, text: str, at: int, final: bool) -> Optional[BlockProgress]:
        """V3 wraps the arguments in a json code fence; accept them bare too."""
        self.fenced = text.startswith(FENCE, at)
        if not self.fenced:
            if at == len(text) or text.startswith(FENCE[:len(text) - at], at):
                return self.status_of(NEED, final)
            self.pos, self.phase = at, _ARGS
            return None
        after, _ = match_any(text, at, (FENCE + "json", FENCE + "\n"), final)
        if after < 0:
            return self.status_of(after, final)
        self.pos, self.phase = after, _ARGS
        return None


class DeepSeekV3ToolParser(ToolParser):
    name = "deepseek_v3"
    needs_special_tokens = True   # the tool markers are special tokens
    markers = (CALLS_BEGIN,)
    block_reader = DeepSeekBlock

"""The Mistral format: ``[TOOL_CALLS]`` then either a JSON list of call objects (older
tokenizers: ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]``) or, with v11+
tokenizers, ``[TOOL_CALLS]NAME[ARGS]{...}`` once per call (optionally ``[CALL_ID]id``
before ``[ARGS]``; ``[ARGS]`` may be missing when the text was detokenized without
special tokens).

Built by the server per request choice (see base.py); pure Python, server side.
"""

from typing import Optional

from cvllm.chat.tool_parsers.base import ToolParser
from cvllm.chat.tool_parsers.blocks import (
    FAIL, NEED, BlockProgress, BlockReader, PartialCall, find_first, read_name, skip_ws)
from cvllm.chat.tool_parsers.json_calls import JsonArgs, JsonCalls, read_json

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
CALL_ID = "[CALL_ID]"


class MistralBlock(BlockReader):
    """One ``[TOOL_CALLS]`` block in either layout (decided by its first character)."""

    def __init__(self, tools, start: int, body: int):
        super().__init__(tools, start, body)
        self.reader = None   # JsonCalls (list layout) or JsonArgs (name layout)

    def read(self, text: str, final: bool) -> BlockProgress:
        if self.reader is None:
            step = self._open(text, final)
            if step is not None:
                return step
        progress = read_json(self, self.reader, text, final)
        return self.done(self.reader.end) if progress is None else progress

    def _open(self, text: str, final: bool) -> Optional[BlockProgress]:
        at = skip_ws(text, self.pos)
        if at == len(text):
            return self.status_of(NEED, final)
        if text[at] in "[{":
            self.reader = JsonCalls(self.tools, at, self.calls, allow_list=True)
            return None
        end, after, name = read_name(text, at, (ARGS, CALL_ID, "{"), final)
        if end < 0 or not self.tools.accepts(name):
            return self.status_of(end if end < 0 else FAIL, final)
        if text.startswith(CALL_ID, end):
            # The id the model wrote is not used: ids come from the server's factory.
            end, _ = find_first(text, after, (ARGS, "{"))
            if end < 0:
                return self.status_of(FAIL if final or len(text) - after > 64 else end, final)
        if text.startswith(ARGS, end):
            end += len(ARGS)
        self.calls.append(PartialCall(name))
        self.reader = JsonArgs(end, self.calls[0])
        return None


class MistralToolParser(ToolParser):
    name = "mistral"
    needs_special_tokens = True   # [TOOL_CALLS] is a control token
    markers = (TOOL_CALLS,)
    block_reader = MistralBlock

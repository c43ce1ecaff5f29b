"""The Llama 3.x / Llama 4 JSON format: ``<|python_tag|>`` optionally, then call objects
``{"name": ..., "parameters": {...}}`` (or "arguments"), several separated by ``;``.

Without ``<|python_tag|>`` a call is recognised only at the very start of the output
and must carry its "parameters" / "arguments" (so a plain JSON answer is not taken for
a call). Built by the server per request choice (see base.py); pure Python, server side.
"""

from typing import Optional

from cvllm.chat.tool_parsers.base import StartBlock, ToolParser
from cvllm.chat.tool_parsers.blocks import BlockProgress, BlockReader, skip_ws
from cvllm.chat.tool_parsers.json_calls import JsonCalls, read_json

PYTHON_TAG = "<|python_tag|>"


class Llama3Block(BlockReader):
    """Call objects separated by ``;``; the block ends after the last object."""

    def __init__(self, tools, start: int, body: int, require_args: bool = False):
        super().__init__(tools, start, body)
        self.require_args = require_args
        self.json: Optional[JsonCalls] = JsonCalls(tools, body, self.calls,
                                                   require_args=require_args)
        self.last_end = -1

    def read(self, text: str, final: bool) -> BlockProgress:
        while True:
            if self.json is not None:
                progress = read_json(self, self.json, text, final)
                if progress is not None:
                    return progress
                self.last_end, self.json = self.json.end, None
            # After an object: ";" and another object continue the block.
            at = skip_ws(text, self.last_end)
            if at < len(text) and text[at] == ";":
                at = skip_ws(text, at + 1)
                if at < len(text) and text[at] == "{":
                    self.json = JsonCalls(self.tools, at, self.calls,
                                          require_args=self.require_args)
                    continue
            if at == len(text) and not final:
                return self.pending()
            return self.done(self.last_end)


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    needs_special_tokens = True   # <|python_tag|> is a special token
    markers = (PYTHON_TAG,)
    block_reader = Llama3Block   # after the tag: calls need no "parameters"

    def _output_start(self, text: str, pos: int, final: bool) -> StartBlock:
        if text[pos] == "{":
            return Llama3Block(self.tools, pos, pos, require_args=True), pos
        return None

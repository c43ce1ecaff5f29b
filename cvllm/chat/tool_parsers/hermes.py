"""The hermes format (Qwen2.5 / Qwen3 / Hermes models): one JSON call object per block,
``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, several in a row.

``HermesToolParser`` is built by the server per request choice (see base.py); its
block reader lives for one block. Pure Python, server side.
"""

from cvllm.chat.tool_parsers.base import ToolParser
from cvllm.chat.tool_parsers.blocks import BlockProgress, BlockReader
from cvllm.chat.tool_parsers.json_calls import DONE, JsonCalls, read_json

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"


class HermesBlock(BlockReader):
    """``<tool_call>`` whitespace, one call object, whitespace, ``</tool_call>``."""

    def __init__(self, tools, start: int, body: int):
        super().__init__(tools, start, body)
        self.json = JsonCalls(tools, body, self.calls)

    def read(self, text: str, final: bool) -> BlockProgress:
        if self.json.status != DONE:
            progress = read_json(self, self.json, text, final)
            if progress is not None:
                return progress
            self.pos = self.json.end
        return self.expect_end(text, final, TOOL_CALL_CLOSE)


class HermesToolParser(ToolParser):
    name = "hermes"
    needs_special_tokens = False   # Qwen's <tool_call> is an added token, not a special one
    markers = (TOOL_CALL_OPEN,)
    block_reader = HermesBlock

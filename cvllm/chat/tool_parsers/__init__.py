"""Tool-call parsers by name, and the choice of one for a model.

``TOOL_PARSERS`` maps every name and alias to its class; the server resolves the
``--tool-call-parser`` flag with ``get_tool_parser``, or, when the flag is ``auto``,
with ``detect_tool_parser`` from the model's chat template and HF architecture, once at
start-up. It then builds one parser instance per request choice. Pure Python, no torch.
"""

from typing import Callable, Dict, Optional, Type

from cvllm.chat.registry import ParserTable
from cvllm.chat.tool_parsers.base import (
    ExtractedToolCalls, StreamDelta, ToolCall, ToolCallDelta, ToolParser, new_call_id)
from cvllm.chat.tool_parsers.deepseek import CALL_BEGIN, CALLS_BEGIN, DeepSeekV3ToolParser
from cvllm.chat.tool_parsers.glm import Glm45ToolParser
from cvllm.chat.tool_parsers.hermes import HermesToolParser
from cvllm.chat.tool_parsers.llama3 import PYTHON_TAG, Llama3JsonToolParser
from cvllm.chat.tool_parsers.mistral import TOOL_CALLS, MistralToolParser
from cvllm.chat.tool_parsers.plain import JsonToolParser, PassthroughToolParser
from cvllm.chat.tool_parsers.qwen3_coder import Qwen3CoderToolParser

_ALIASES = {
    HermesToolParser: ("hermes", "qwen", "qwen2", "qwen2_5", "qwen3"),
    Qwen3CoderToolParser: ("qwen3_coder",),
    MistralToolParser: ("mistral",),
    Llama3JsonToolParser: ("llama3_json", "llama3", "llama4_json"),
    DeepSeekV3ToolParser: ("deepseek_v3", "deepseek_v31"),
    Glm45ToolParser: ("glm45", "glm4.5", "glm47", "glm4.7"),
    JsonToolParser: ("json",),
    PassthroughToolParser: ("passthrough",),
}

TOOL_PARSERS: Dict[str, Type[ToolParser]] = {
    alias: cls for cls, aliases in _ALIASES.items() for alias in aliases}

_TABLE = ParserTable(
    "tool-call parser", TOOL_PARSERS,
    # Chat-template markers, most specific first: GLM and Qwen3-Coder also use <tool_call>.
    template_markers=(
        (CALLS_BEGIN, "deepseek_v3"),
        (CALL_BEGIN, "deepseek_v3"),
        ("<arg_key>", "glm45"),
        ("<function=", "qwen3_coder"),
        ("<tool_call>", "hermes"),
        (TOOL_CALLS, "mistral"),
        (PYTHON_TAG, "llama3_json"),
    ),
    architectures={
        "Qwen2ForCausalLM": "hermes",
        "Qwen2MoeForCausalLM": "hermes",
        "Qwen3ForCausalLM": "hermes",
        "Qwen3MoeForCausalLM": "hermes",
        "MistralForCausalLM": "mistral",
        "MixtralForCausalLM": "mistral",
        "Mistral3ForConditionalGeneration": "mistral",
        "LlamaForCausalLM": "llama3_json",
        "Llama4ForCausalLM": "llama3_json",
        "Llama4ForConditionalGeneration": "llama3_json",
        "DeepseekV3ForCausalLM": "deepseek_v3",
        "Glm4MoeForCausalLM": "glm45",
    })

get_tool_parser: Callable[[str], Type[ToolParser]] = _TABLE.get
"""The parser class for a name (an alias works too); a ValueError names the known ones."""
detect_tool_parser: Callable[[Optional[str], Optional[str]], Optional[str]] = _TABLE.detect
"""``(architecture, chat_template)`` -> the parser name for a model: from the markers its
chat template writes, else from its HF architecture name; None when no tool format is
known for it."""


__all__ = [
    "TOOL_PARSERS", "get_tool_parser", "detect_tool_parser", "ToolParser", "ToolCall",
    "ToolCallDelta", "StreamDelta", "ExtractedToolCalls", "new_call_id",
]

"""One round of one choice, read through the reasoning split and then the tool parser.

Built by ``agent.ChoiceRun`` for each generation round of a choice (rank 0, event-loop
thread) and fed every engine output's text; pure Python, no engine, no aiohttp. The
reasoning parser runs first and the tool parser reads only the content, so markup
inside reasoning is never a call. The streamed path and the non-streamed one both feed
the deltas through ``feed``/``finish`` (the parsers guarantee that any split gives the
result of the whole text), so what a stream sends reassembles to the non-streamed body.

``reasoning_tokens`` counts the generated tokens of the outputs whose text starts before
the reasoning's end tag (all of them when the reasoning never ended), from the token
counts the engine reports per output: no second tokenization.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Tuple

from cvllm.chat.reasoning import prompt_opens_reasoning
from cvllm.chat.tool_parsers import ToolCall, ToolCallDelta
from cvllm.server.agent_plan import ChatPlan


@dataclass
class ParsedDelta:
    """What one engine output (or the end of the round) adds."""

    reasoning: str = ""
    content: str = ""
    tool_calls: List[ToolCallDelta] = field(default_factory=list)
    abandoned: List[int] = field(default_factory=list)
    """Parser indices of calls announced earlier that turned out broken."""


class ChoiceParser:
    """The parser pair of one round of one choice, and what it has read so far."""

    def __init__(self, plan: ChatPlan, prompt_text: str):
        self.reasoning = None
        if plan.reasoning_parser is not None:
            probe = plan.reasoning_parser()
            opens = prompt_opens_reasoning(prompt_text, probe.start_tag, probe.end_tag)
            self.reasoning = plan.reasoning_parser(starts_in_reasoning=opens)
        self.tools = (plan.tool_parser(plan.parser_tools)
                      if plan.tool_parser is not None else None)
        self._raw: List[str] = []
        self._raw_len = 0
        self._marks: List[Tuple[int, int]] = []  # (text offset, tokens) per engine output
        self._reasoning: List[str] = []
        self._content: List[str] = []
        self._calls: Dict[int, List] = {}        # parser index -> [id, name, [arguments]]

    def feed(self, delta_text: str, num_tokens: int) -> ParsedDelta:
        self._marks.append((self._raw_len, num_tokens))
        self._raw.append(delta_text)
        self._raw_len += len(delta_text)
        if self.reasoning is None:
            return self._tool_step("", delta_text, final=False)
        r, c = self.reasoning.stream(delta_text)
        return self._tool_step(r, c, final=False)

    def finish(self) -> ParsedDelta:
        r, c = self.reasoning.finish() if self.reasoning is not None else ("", "")
        return self._tool_step(r, c, final=True)

    def _tool_step(self, reasoning: str, content: str, final: bool) -> ParsedDelta:
        out = ParsedDelta(reasoning=reasoning)
        if self.tools is None:
            out.content = content
        else:
            if content:
                self._merge(out, self.tools.stream(content))
            if final:
                self._merge(out, self.tools.finish())
        if out.reasoning:
            self._reasoning.append(out.reasoning)
        if out.content:
            self._content.append(out.content)
        return out

    def _merge(self, out: ParsedDelta, step) -> None:
        out.content += step.content
        out.abandoned.extend(step.abandoned)
        for index in step.abandoned:
            self._calls.pop(index, None)
        for d in step.tool_calls:
            entry = self._calls.setdefault(d.index, [d.id, d.name, []])
            if d.arguments:
                entry[2].append(d.arguments)
            out.tool_calls.append(d)

    # ---------------------------------------------------------------- the round's result
    @property
    def content(self) -> str:
        return "".join(self._content)

    @property
    def reasoning_text(self) -> str:
        return "".join(self._reasoning)

    def calls(self) -> List[ToolCall]:
        """The calls read so far, in order (after ``finish``: the round's calls)."""
        return [ToolCall(e[0], e[1], "".join(e[2])) for _, e in sorted(self._calls.items())]

    def reasoning_tokens(self) -> int:
        if self.reasoning is None or not self._reasoning:
            return 0
        raw = "".join(self._raw)
        end = raw.find(self.reasoning.end_tag)
        if end < 0:
            return sum(n for _, n in self._marks)
        return sum(n for offset, n in self._marks if offset < end)

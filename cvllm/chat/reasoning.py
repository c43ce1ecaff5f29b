"""Reasoning parsers: split a completion into ``reasoning_content`` and ``content`` at the
model's think tags (``<think>`` ... ``</think>``).

``ReasoningParser`` is built by the server (one instance per request choice; the class
is chosen once at start-up with ``get_reasoning_parser`` / ``detect_reasoning_parser``)
and owned by that choice's output loop; pure Python, no torch, server side. The caller
decides ``starts_in_reasoning`` from the rendered prompt with ``prompt_opens_reasoning``
(a template that opens ``<think>`` itself makes the output start inside reasoning). The
tool-call parser then runs on the content stream only, so markup inside reasoning is
never a call.

The rules, the same for ``extract`` and for any split into ``stream`` deltas (both run
one engine, which decides nothing until the text seen so far settles it):
  * reasoning starts when the output begins (after whitespace) with the start tag, or at
    once with ``starts_in_reasoning`` (a start tag the model writes anyway is dropped);
    a start tag anywhere else is plain text;
  * reasoning ends at the first end tag; without one, everything after the start was
    reasoning; neither tag ever reaches the content;
  * reasoning is stripped of whitespace at both ends; the content after the end tag has
    its leading whitespace removed; output that never entered reasoning is content as is.
"""

from typing import Callable, ClassVar, Dict, List, Optional, Tuple, Type

from cvllm.chat.registry import ParserTable

_OPENING, _THINKING_START, _THINKING, _CONTENT_START, _CONTENT = range(5)


def prompt_opens_reasoning(prompt_text: str, start: str = "<think>", end: str = "</think>") -> bool:
    """Whether the rendered prompt leaves a reasoning block open (its last start tag has no
    end tag after it), so the output begins inside reasoning."""
    at = prompt_text.rfind(start)
    return at >= 0 and prompt_text.find(end, at + len(start)) < 0


def _partial_suffix(text: str, pos: int, tag: str) -> int:
    """Length of the longest suffix of ``text[pos:]`` that is a proper prefix of ``tag``."""
    for size in range(min(len(tag) - 1, len(text) - pos), 0, -1):
        if tag.startswith(text[len(text) - size:]):
            return size
    return 0


class _Split:
    """The engine: one pass over one output, fed piece by piece."""

    def __init__(self, start: str, end: str, in_reasoning: bool):
        self.start, self.end = start, end
        self.mode = _THINKING_START if in_reasoning else _OPENING
        self.swallow_start = in_reasoning
        self.text = ""
        self.pos = 0
        self.held_ws = ""
        self.finished = False

    def feed(self, delta: str, final: bool) -> Tuple[str, str]:
        out: List[str] = ["", ""]
        if self.finished:
            return "", ""
        self.text += delta if isinstance(delta, str) else ""
        while self._step(out, final):
            pass
        if final:
            self.finished = True
        if self.pos > 0:   # decided text is never read again
            self.text, self.pos = self.text[self.pos:], 0
        return out[0], out[1]

    def _skip_ws(self) -> int:
        k = self.pos
        while k < len(self.text) and self.text[k].isspace():
            k += 1
        return k

    def _step(self, out: List[str], final: bool) -> bool:
        """Move on by one decision; False when waiting for more text (or at the end)."""
        text, mode = self.text, self.mode
        if mode == _OPENING:
            return self._opening(final)
        if mode == _THINKING_START:
            return self._thinking_start(final)
        if mode == _THINKING:
            return self._thinking(out, final)
        if mode == _CONTENT_START:
            k = self._skip_ws()
            self.pos = k
            if k == len(text):
                return False
            self.mode = _CONTENT
            return True
        out[1] += text[self.pos:]
        self.pos = len(text)
        return False

    def _thinking_start(self, final: bool) -> bool:
        # Whitespace here is dropped whatever follows, so pos may pass it at once.
        text = self.text
        k = self.pos = self._skip_ws()
        if k == len(text):
            return False
        if self.swallow_start:
            if text.startswith(self.start, k):
                self.pos, self.swallow_start = k + len(self.start), False
                return True
            if not final and len(text) - k < len(self.start) and self.start.startswith(text[k:]):
                return False
            self.swallow_start = False
        self.mode = _THINKING
        return True

    def _opening(self, final: bool) -> bool:
        text = self.text
        k = self._skip_ws()
        rest = text[k:]
        if text.startswith(self.start, k):
            self.pos, self.mode = k + len(self.start), _THINKING_START
            return True
        may_be_start = len(rest) < len(self.start) and self.start.startswith(rest)
        if not final and (not rest or may_be_start):
            return False
        self.mode = _CONTENT
        return True

    def _thinking(self, out: List[str], final: bool) -> bool:
        text = self.text
        j = text.find(self.end, self.pos)
        if j >= 0:
            self._reason(out, text[self.pos:j])
            self.pos, self.mode = j + len(self.end), _CONTENT_START
            return True
        keep = 0 if final else _partial_suffix(text, self.pos, self.end)
        self._reason(out, text[self.pos:len(text) - keep])
        self.pos = len(text) - keep
        return False

    def _reason(self, out: List[str], piece: str) -> None:
        """Reasoning text, holding a trailing whitespace run until more reasoning follows."""
        body = piece.rstrip()
        if body:
            out[0] += self.held_ws + body
            self.held_ws = piece[len(body):]
        else:
            self.held_ws += piece


class ReasoningParser:
    """Think-tag reasoning (qwen3-style): the output may open with the start tag."""

    name: ClassVar[str] = "qwen3"
    default_starts_in_reasoning: ClassVar[bool] = False
    """What ``starts_in_reasoning=None`` means for this family."""

    def __init__(self, start: str = "<think>", end: str = "</think>",
                 starts_in_reasoning: Optional[bool] = None):
        self.start_tag = start
        self.end_tag = end
        self.starts_in_reasoning = (self.default_starts_in_reasoning
                                    if starts_in_reasoning is None else bool(starts_in_reasoning))
        self._split = self._new_split()

    def _new_split(self) -> _Split:
        return _Split(self.start_tag, self.end_tag, self.starts_in_reasoning)

    def extract(self, text: str) -> Tuple[Optional[str], str]:
        """(reasoning_content or None, content) of a whole completion."""
        reasoning, content = self._new_split().feed(text, final=True)
        return reasoning or None, content

    def stream(self, delta_text: str) -> Tuple[str, str]:
        """(reasoning delta, content delta) that ``delta_text`` adds."""
        return self._split.feed(delta_text, final=False)

    def finish(self) -> Tuple[str, str]:
        """End of generation: what was held back (a partial tag is text after all)."""
        return self._split.feed("", final=True)


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"


class Glm45ReasoningParser(ReasoningParser):
    name = "glm45"


class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1: the template opens ``<think>``, so the output starts in reasoning and
    may hold only the end tag (unless the caller says the prompt did not open it)."""

    name = "deepseek_r1"
    default_starts_in_reasoning = True


class NoReasoningParser(ReasoningParser):
    """Everything is content."""

    name = "none"

    def _new_split(self) -> _Split:
        split = _Split(self.start_tag, self.end_tag, False)
        split.mode = _CONTENT
        return split


REASONING_PARSERS: Dict[str, Type[ReasoningParser]] = {
    cls.name: cls for cls in (Qwen3ReasoningParser, Glm45ReasoningParser,
                              DeepSeekR1ReasoningParser, NoReasoningParser)}
REASONING_PARSERS["glm4.5"] = Glm45ReasoningParser

_TABLE = ParserTable(
    "reasoning parser", REASONING_PARSERS,
    # A template with think tags: which family writes it (else Qwen3's).
    template_markers=(("<｜Assistant｜>", "deepseek_r1"), ("<arg_key>", "glm45"),
                      ("[gMASK]", "glm45")),
    architectures={"Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3",
                   "Glm4MoeForCausalLM": "glm45"},
    template_gate=("<think>", "</think>"), template_default="qwen3")

get_reasoning_parser: Callable[[str], Type[ReasoningParser]] = _TABLE.get
"""The reasoning parser class for a name; a ValueError names the known ones."""
detect_reasoning_parser: Callable[[Optional[str], Optional[str]], Optional[str]] = _TABLE.detect
"""``(architecture, chat_template)`` -> the reasoning parser name for a model: from its
chat template's think tags (and which family writes them), else from its HF architecture;
None when it has none."""

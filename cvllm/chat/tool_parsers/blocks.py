"""Block readers: the interface between the shared stream engine and one tool-call format.

A *block* is the markup of one or more calls that starts at a format's opening marker
(``<tool_call>``, ``[TOOL_CALLS]``, ...). When the engine in ``base.py`` finds one, it
asks the parser for a ``BlockReader`` and then calls ``read(text, final)`` each time more
text has arrived, until the reader says DONE or BROKEN. Readers are built and owned by
the engine of one parser instance (server side, pure Python); they live for one block.

The contract that makes streaming exact for any split of the text into deltas:
  * ``text`` is the same growing string each time (never shorter, never changed);
  * DONE / BROKEN are returned only when no further text could change the answer
    (otherwise PENDING; with ``final`` there is no further text, so never PENDING);
  * ``calls`` only grows, a call's name never changes, and a call's ``arguments`` only
    ever grows (what was streamed stays a prefix of the final arguments).

Also here: the two shapes most readers take (``PhasedReader``, a state machine stepped one
phase at a time; ``TextArgsReader``, one whose values are text between XML-style tags)
and small cursor helpers that every reader uses to match literals with holdback.
"""

import abc
import enum
from dataclasses import dataclass, field
from typing import Iterable, List, Optional, Tuple

from cvllm.chat.tool_parsers.arguments import ArgsBuilder, ToolSet

NEED = -1
"""``match_literal`` / ``find_first``: the text ends inside what is looked for."""
FAIL = -2
"""``match_literal``: the text there is something else."""


class BlockStatus(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    BROKEN = "broken"


@dataclass
class PartialCall:
    """One call of a block as far as it is known: announced once it has a valid name."""

    name: str
    arguments: str = ""


@dataclass
class BlockProgress:
    """What a reader knows after one ``read``; ``end`` (absolute position after the block's
    last character) is set when DONE."""

    status: BlockStatus
    calls: List[PartialCall] = field(default_factory=list)
    end: int = 0


class BlockReader(abc.ABC):
    """Reads one block that starts at ``start`` (its opening marker) and whose body starts
    at ``body``; positions are absolute indices into the engine's text."""

    def __init__(self, tools: ToolSet, start: int, body: int):
        self.tools = tools
        self.start = start
        self.pos = body
        self.calls: List[PartialCall] = []

    @abc.abstractmethod
    def read(self, text: str, final: bool) -> BlockProgress:
        """Advance over ``text`` (which only grows between calls) and say where it stands."""

    def pending(self) -> BlockProgress:
        return BlockProgress(BlockStatus.PENDING, self.calls)

    def broken(self) -> BlockProgress:
        return BlockProgress(BlockStatus.BROKEN, self.calls)

    def done(self, end: int) -> BlockProgress:
        return BlockProgress(BlockStatus.DONE, self.calls, end)

    def status_of(self, where: int, final: bool) -> BlockProgress:
        """PENDING or BROKEN for a literal match that gave NEED or FAIL."""
        return self.pending() if where == NEED and not final else self.broken()

    def expect_end(self, text: str, final: bool, literal: str) -> BlockProgress:
        """DONE after optional whitespace and the closing ``literal`` at ``self.pos``."""
        where = match_literal(text, skip_ws(text, self.pos), literal, final)
        return self.done(where) if where >= 0 else self.status_of(where, final)


class PhasedReader(BlockReader):
    """A reader written as a small state machine: ``_step`` moves one phase on and
    returns None, or returns the progress to report when it cannot go further."""

    def read(self, text: str, final: bool) -> BlockProgress:
        while True:
            step = self._step(text, final)
            if step is not None:
                return step

    @abc.abstractmethod
    def _step(self, text: str, final: bool) -> Optional[BlockProgress]:
        """Move one phase on (None), or say where the block stands."""


def skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def match_literal(text: str, pos: int, literal: str, final: bool) -> int:
    """The position after ``literal`` at ``pos``; NEED when the text ends inside it (and
    more may come), FAIL when something else is there."""
    if text.startswith(literal, pos):
        return pos + len(literal)
    rest = text[pos:]
    if not final and len(rest) < len(literal) and literal.startswith(rest):
        return NEED
    return FAIL


def match_any(text: str, pos: int, literals: Tuple[str, ...],
              final: bool) -> Tuple[int, str]:
    """The first of ``literals`` found at ``pos``: (position after it, the literal), or
    (NEED, "") while one may still come, or (FAIL, "")."""
    result = FAIL
    for literal in literals:
        where = match_literal(text, pos, literal, final)
        if where >= 0:
            return where, literal
        if where == NEED:
            result = NEED
    return result, ""


def partial_suffix(text: str, pos: int, tokens: Iterable[str]) -> int:
    """Length of the longest suffix of ``text[pos:]`` that is a proper prefix of a token:
    what a stream holds back because it may be the start of that token."""
    tokens = tuple(tokens)
    longest = max((len(t) for t in tokens), default=1) - 1
    for size in range(min(longest, len(text) - pos), 0, -1):
        tail = text[len(text) - size:]
        if any(t.startswith(tail) for t in tokens):
            return size
    return 0


def find_first(text: str, pos: int, tokens: Tuple[str, ...]) -> Tuple[int, str]:
    """The earliest token at or after ``pos`` (longest first on a tie), or (NEED, "")."""
    best, found = NEED, ""
    for token in tokens:
        j = text.find(token, pos)
        if j >= 0 and (best == NEED or j < best or (j == best and len(token) > len(found))):
            best, found = j, token
    return best, found


def read_name(text: str, pos: int, ends: Tuple[str, ...], final: bool,
              limit: int = 256) -> Tuple[int, int, str]:
    """A function name that runs from ``pos`` to the first of ``ends``: returns
    (position of that end, or NEED / FAIL; position after it; the name, stripped)."""
    j, end = find_first(text, pos, ends)
    if j == NEED:
        if final or len(text) - pos > limit:
            return FAIL, 0, ""
        return NEED, 0, ""
    if j - pos > limit:
        return FAIL, 0, ""
    return j, j + len(end), text[pos:j].strip()


class TextValue:
    """One parameter value given as text up to ``close`` (XML-style formats), written into
    an ``ArgsBuilder``: a string value streams as it arrives, holding back what may be the
    closing tag (and, with ``trim_newlines``, the one newline the template puts before
    it); any other type is converted once the value is complete."""

    def __init__(self, args: ArgsBuilder, key: str, start: int, close: str,
                 trim_newlines: bool):
        self.args = args
        self.key = key
        self.start = start
        self.sent = start
        self.close = close
        self.trim = trim_newlines
        self.began = not trim_newlines
        self.searched = start
        self.string = args.is_string(key)
        if self.string:
            args.open_string(key)

    def read(self, text: str, final: bool) -> int:
        """The position after the closing tag once the value is complete, NEED before,
        FAIL when the text ended without it."""
        if not self.began:
            if self.start >= len(text):
                return FAIL if final else NEED
            if text[self.start] == "\n":
                self.start += 1
                self.sent = self.start
            self.began = True
        j = text.find(self.close, max(self.start, self.searched))
        if j < 0:
            # No closing tag starts before this point: the next search begins here.
            self.searched = len(text) - len(self.close) + 1
            if final:
                return FAIL
            if self.string:
                safe = len(text) - partial_suffix(text, self.start, (self.close,))
                self._send(text, self._trimmed_end(text, safe))
            return NEED
        end = self._trimmed_end(text, j)
        if self.string:
            self._send(text, end)
            self.args.close_string()
        else:
            self.args.add_typed(self.key, text[self.start:end])
        return j + len(self.close)

    def _trimmed_end(self, text: str, end: int) -> int:
        if self.trim and end > self.start and text[end - 1] == "\n":
            return end - 1
        return end

    def _send(self, text: str, end: int) -> None:
        if end > self.sent:
            self.args.add_string(text[self.sent:end])
            self.sent = end


class TextArgsReader(PhasedReader):
    """A block of one call whose parameter values are text (``TextValue``s written into an
    ``ArgsBuilder``, XML-style formats); the call's arguments follow the builder's text
    after each ``read``. A format's ``_markup_step`` reads the tags between the values;
    while a value is open (``open_value``) this reads it, then the markup goes on in the
    phase it left."""

    def __init__(self, tools: ToolSet, start: int, body: int, phase: int):
        super().__init__(tools, start, body)
        self.phase = phase
        self.args: Optional[ArgsBuilder] = None
        self.value: Optional[TextValue] = None

    def open_call(self, name: str) -> None:
        """Announce the call ``name`` (one the tools accept) and start its arguments."""
        self.calls.append(PartialCall(name))
        self.args = ArgsBuilder(self.tools, name)

    def open_value(self, key: str, start: int, close: str, trim_newlines: bool) -> None:
        """The value of ``key`` runs from ``start`` to the tag ``close`` (``TextValue``)."""
        self.value = TextValue(self.args, key, start, close, trim_newlines)

    def read(self, text: str, final: bool) -> BlockProgress:
        progress = super().read(text, final)
        if self.calls and self.args is not None:
            self.calls[0].arguments = self.args.text
        return progress

    def _step(self, text: str, final: bool) -> Optional[BlockProgress]:
        if self.value is None:
            return self._markup_step(text, final)
        after = self.value.read(text, final)
        if after == NEED:
            return self.pending()
        if after == FAIL:
            return self.broken()
        self.pos, self.value = after, None
        return None

    @abc.abstractmethod
    def _markup_step(self, text: str, final: bool) -> Optional[BlockProgress]:
        """``_step`` outside the values."""

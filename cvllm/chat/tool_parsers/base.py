"""Tool-call parsing: the boundary dataclasses, the ``ToolParser`` interface, and the one
stream engine every format shares.

A ``ToolParser`` is built by the server (engine/ or server/, one instance per request
choice, from the request's ``tools``) and owned by that choice's output loop; it runs
where the text is detokenized, never on other ranks, and never imports torch. The
server calls ``extract(text)`` for a whole completion, or ``stream(delta)`` for each new
piece of text and ``finish()`` at the end of generation.

How the engine reads text (``_Run``). Outside calls it looks for the format's opening
markers and for code fences: markup inside a fenced block (between two ``\u0060\u0060\u0060``) is
content, and a suffix that may be the start of a marker or fence is held back. At a
marker it opens a ``BlockReader`` (blocks.py) and feeds it until the block is DONE (its
calls are complete) or BROKEN; a broken block's marker is released as content and the
text after it is read again as ordinary text, so nothing is ever dropped. Some formats
also accept a call at the very start of the output without a marker (``_output_start``).

``extract`` runs the same engine over the whole text at once, so for any split of a text
into deltas the streamed result is the extracted one (the stream decides nothing until
the text seen so far settles it). The content rule, the same in both: content is the
text outside the calls, with leading and trailing whitespace removed, and None (streamed:
nothing) when that is empty. A stream therefore drops leading whitespace and holds a run
of whitespace until more content follows it.

A call is announced (a delta with index, id and name) once its name is known and valid,
then its arguments stream. Should its block then break (the text ends inside it, or its
arguments turn out not to be JSON), the call's index is listed in
``StreamDelta.abandoned`` and the block's text is released as content, as ``extract``
would have it; ``extract`` never reports such a call.
"""

import abc
import logging
import re
import secrets
from dataclasses import dataclass, field
from typing import Callable, ClassVar, List, Optional, Tuple, Union

from cvllm.chat.tool_parsers.arguments import ToolSet
from cvllm.chat.tool_parsers.blocks import BlockReader, BlockStatus, PartialCall, partial_suffix

logger = logging.getLogger(__name__)

FENCE = "\u0060\u0060\u0060"
"""A Markdown code fence (three backticks)."""


@dataclass
class ToolCall:
    """One complete call, as the non-streamed response lists it."""

    id: str
    name: str
    arguments: str
    """A JSON object as text."""


@dataclass
class ExtractedToolCalls:
    """The non-streamed result of a whole completion's text."""

    content: Optional[str]
    """Text outside the calls, stripped; None when there is none."""
    tool_calls: List[ToolCall]


@dataclass
class ToolCallDelta:
    """OpenAI's streamed ``delta.tool_calls[i]``."""

    index: int
    id: Optional[str] = None
    """Only on the first delta of a call (with ``name``)."""
    name: Optional[str] = None
    arguments: Optional[str] = None
    """A fragment of the arguments text."""


@dataclass
class StreamDelta:
    """What one ``stream()`` / ``finish()`` call adds to the response."""

    content: str = ""
    tool_calls: List[ToolCallDelta] = field(default_factory=list)
    abandoned: List[int] = field(default_factory=list)
    """Indices of calls announced earlier whose markup turned out broken; their text is
    now part of the content, and a server should not report them as calls."""


def new_call_id() -> str:
    """An OpenAI-style call id: "call_" and 24 random hex digits."""
    return "call_" + secrets.token_hex(12)


class Undecided:
    """``_output_start`` cannot tell yet whether the output starts with a call."""


UNDECIDED = Undecided()
StartBlock = Union[None, Undecided, Tuple[BlockReader, int]]


class ToolParser(abc.ABC):
    """One tool-call format. Subclasses declare their ``markers`` and the
    ``block_reader`` that reads the block each opens; the engine does the rest."""

    name: ClassVar[str]
    needs_special_tokens: ClassVar[bool] = False
    """True when the markers are special tokens that ``skip_special_tokens=True`` drops."""
    markers: ClassVar[Tuple[str, ...]] = ()
    """Opening markers of a block of calls."""
    block_reader: ClassVar[Optional[Callable[[ToolSet, int, int], BlockReader]]] = None
    """Builds the reader of a block from (tools, its marker's start, its body's start)."""

    def __init__(self, tools: Optional[List[dict]] = None,
                 id_factory: Callable[[], str] = new_call_id):
        self.tools = ToolSet(tools if isinstance(tools, list) else None)
        self.id_factory = id_factory
        self._run = _Run(self)

    def extract(self, text: str) -> ExtractedToolCalls:
        """Calls and content of a whole completion; does not touch the stream's state."""
        run = _Run(self)
        delta = run.feed(text if isinstance(text, str) else "", final=True)
        return ExtractedToolCalls(delta.content or None, list(run.completed))

    def stream(self, delta_text: str) -> StreamDelta:
        """What ``delta_text`` (the next piece of the output) adds."""
        return self._run.feed(delta_text if isinstance(delta_text, str) else "", final=False)

    def finish(self) -> StreamDelta:
        """End of generation: settle every open block and release what was held."""
        return self._run.feed("", final=True)

    def _open_block(self, marker: str, start: int) -> BlockReader:
        """A reader for the block whose ``marker`` starts at ``start``."""
        if self.block_reader is None:
            raise NotImplementedError(f"{type(self).__name__} declares no markers")
        return self.block_reader(self.tools, start, start + len(marker))

    def _output_start(self, text: str, pos: int, final: bool) -> StartBlock:
        """A block at the output's first non-whitespace character ``pos`` without a
        marker: (reader, start) for one, None for none, UNDECIDED to wait for more text."""
        return None


class _Run:
    """One pass of a parser's engine over one output (see the module docstring)."""

    def __init__(self, parser: ToolParser):
        self.parser = parser
        self.text = ""
        self.pos = 0                # everything before it is decided
        self.in_fence = False
        self.start_open = True      # the output-start check is still to be made
        self.skip_at = -1           # the marker of a broken block: read it as text
        self.block: Optional[BlockReader] = None
        self.announced: List[List] = []   # [index, id, arguments sent] per call of the block
        self.next_index = 0
        self.completed: List[ToolCall] = []
        self.content_started = False
        self.held_ws = ""
        self.finished = False
        self.failed = False
        tokens = tuple(parser.markers)
        self._tokens = {False: (FENCE,) + tokens, True: (FENCE,)}
        self._patterns = {k: re.compile("|".join(re.escape(t) for t in sorted(v, key=len)[::-1]))
                          for k, v in self._tokens.items()}

    def feed(self, delta: str, final: bool) -> StreamDelta:
        out = StreamDelta()
        if self.finished:
            return out
        self.text += delta
        try:
            if self.failed:
                self._release_rest(out)
            else:
                self._advance(out, final)
        except Exception:   # noqa: BLE001 -- a parser must never fail a request
            logger.exception("%s tool parser failed; the rest is content", self.parser.name)
            self.failed = True
            self._release_rest(out)
        if final:
            self.finished = True
            self.held_ws = ""
        self._rebase()
        return out

    def _release_rest(self, out: StreamDelta) -> None:
        out.abandoned.extend(entry[0] for entry in self.announced)
        self.announced, self.block = [], None
        self._content(out, self.text[self.pos:])
        self.pos = len(self.text)

    def _rebase(self) -> None:
        # Decided text is never read again outside a block: drop it so text stays short.
        if self.block is None and self.pos > 0:
            self.text = self.text[self.pos:]
            self.skip_at -= self.pos
            self.pos = 0

    def _advance(self, out: StreamDelta, final: bool) -> None:
        while True:
            if self.block is not None:
                if not self._drive_block(out, final):
                    return
            elif not self._scan_text(out, final):
                return

    def _drive_block(self, out: StreamDelta, final: bool) -> bool:
        """Feed the open block; False while it waits for more text."""
        block = self.block
        progress = block.read(self.text, final)
        self._announce(out, progress.calls)
        status = progress.status
        if status is BlockStatus.PENDING:
            if not final:
                return False
            status = BlockStatus.BROKEN
        if status is BlockStatus.DONE and progress.end > block.start:
            for (index, call_id, _), call in zip(self.announced, progress.calls):
                self.completed.append(_tool_call(call_id, call))
            self.pos = progress.end
        else:
            out.abandoned.extend(entry[0] for entry in self.announced)
            self.pos = self.skip_at = block.start
        self.block, self.announced = None, []
        return True

    def _announce(self, out: StreamDelta, calls: List[PartialCall]) -> None:
        for i, call in enumerate(calls):
            if i == len(self.announced):
                self.announced.append([self.next_index, self.parser.id_factory(), 0])
                self.next_index += 1
                index, call_id, _ = self.announced[i]
                _add_delta(out, ToolCallDelta(index, call_id, call.name, ""))
            entry = self.announced[i]
            sent = entry[2]
            if len(call.arguments) > sent:
                _add_delta(out, ToolCallDelta(entry[0], arguments=call.arguments[sent:]))
                entry[2] = len(call.arguments)
            elif len(call.arguments) < sent:
                raise RuntimeError("a block reader shortened a call's arguments")

    def _scan_text(self, out: StreamDelta, final: bool) -> bool:
        """Emit text up to the next block; True when one was opened."""
        text, i = self.text, self.pos
        if self.start_open and not self.in_fence:
            opened = self._check_output_start(out, final)
            if opened is not False:
                return opened
        while True:
            m = self._patterns[self.in_fence].search(text, i)
            if m is None:
                keep = 0 if final else partial_suffix(text, i, self._tokens[self.in_fence])
                self._content(out, text[i:len(text) - keep])
                self.pos = len(text) - keep
                return False
            j, token = m.start(), m.group()
            self._content(out, text[i:j])
            i = j + len(token)
            if token == FENCE:
                self.in_fence = not self.in_fence
            elif j != self.skip_at:
                self.pos = j
                self.block = self.parser._open_block(token, j)
                return True
            self._content(out, token)

    def _check_output_start(self, out: StreamDelta, final: bool) -> Union[bool, None]:
        """True: a block was opened; None: wait; False: no block, scan as text."""
        text = self.text
        k = self.pos
        while k < len(text) and text[k].isspace():
            k += 1
        if k == len(text) and not final:
            return None
        found = self.parser._output_start(text, k, final) if k < len(text) else None
        if isinstance(found, Undecided):
            if not final:
                return None
            found = None
        self.start_open = False
        if found is None:
            return False
        reader, start = found
        self._content(out, text[self.pos:start])
        self.pos, self.block = start, reader
        return True

    def _content(self, out: StreamDelta, piece: str) -> None:
        """Emit content under the whitespace rule of the module docstring."""
        if not piece:
            return
        if not self.content_started:
            piece = piece.lstrip()
            if not piece:
                return
            self.content_started = True
        body = piece.rstrip()
        if body:
            out.content += self.held_ws + body
            self.held_ws = piece[len(body):]
        else:
            self.held_ws += piece


def _tool_call(call_id: str, call: PartialCall) -> ToolCall:
    return ToolCall(call_id, call.name, call.arguments)



def _add_delta(out: StreamDelta, delta: ToolCallDelta) -> None:
    """Append a call delta, joining an arguments fragment to the one before it."""
    last = out.tool_calls[-1] if out.tool_calls else None
    if last is not None and delta.id is None and last.id is None and last.index == delta.index:
        last.arguments = (last.arguments or "") + (delta.arguments or "")
    else:
        out.tool_calls.append(delta)

"""JSON tool calls read as they stream: a resumable JSON syntax scanner and, on top of it,
the reader of call objects ``{"name": ..., "arguments": {...}}`` (or a list of them).

Built by the block readers of the JSON-argument formats (hermes, mistral, llama3, json,
and DeepSeek's argument objects) and owned by one block reader; server side, pure Python.

The scanner checks the syntax of one JSON value a character at a time and can stop
anywhere and resume when more text arrives, so a call's arguments can be streamed while
they are generated and a syntax error is found at the first character that makes the
text impossible to complete. The arguments of a call are the model's own text of the
arguments object (a substring of the output), so streamed pieces concatenate to it.
"""

import re
from typing import List, Optional, Tuple

from cvllm.chat.tool_parsers.arguments import ToolSet, strict_loads
from cvllm.chat.tool_parsers.blocks import BlockProgress, BlockReader, PartialCall

_VALUE, _OBJ_FIRST, _OBJ_KEY, _COLON, _AFTER, _ARR_FIRST = range(6)
_STRING, _NUMBER, _LITERAL = range(6, 9)
_STRING_STOP = re.compile(r'["\\\x00-\x1f]')
_NUMBER_CHARS = frozenset("0123456789+-.eE")
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_LITERALS = ("true", "false", "null")
_HEX = frozenset("0123456789abcdefABCDEF")
MAX_DEPTH = 128

PENDING, DONE, ERROR = "pending", "done", "error"


def read_json(block: BlockReader, reader, text: str, final: bool) -> Optional[BlockProgress]:
    """Feed ``reader`` (a ``JsonCalls`` or ``JsonArgs`` inside ``block``): the block's
    PENDING or BROKEN progress while the JSON is not complete, None once it is DONE
    (``reader.end`` set)."""
    status = reader.read(text, final)
    if status == PENDING:
        return block.pending()
    if status == ERROR:
        return block.broken()
    return None


class JsonScanner:
    """Syntax of one JSON value starting at ``start`` (after optional whitespace).

    ``events`` collects ``(kind, depth, pos, key)``: kind "start" at a value's first
    character, "end" with the position after its last; depth 0 is the top value; key is
    the member name for values inside an object. The consumer drains it.
    """

    def __init__(self, start: int):
        self.pos = start
        self.status = PENDING
        self.end = -1
        self.events: List[Tuple[str, int, int, Optional[str]]] = []
        self._state = _VALUE
        self._stack: List[str] = []
        self._keys: List[Optional[str]] = []
        self._token_start = 0
        self._is_key = False
        self._escape = 0   # 0: none, 1: after a backslash, 2..5: hex digits of \\u left, + 1

    def feed(self, text: str) -> None:
        """Scan ``text[self.pos:]``; stops at the end, at the end of the value, or at an error."""
        while self.status == PENDING and self.pos < len(text):
            if self._state == _STRING:
                self._string(text)
            elif self._state == _NUMBER or self._state == _LITERAL:
                self._token(text)
            else:
                ch = text[self.pos]
                if ch in " \t\n\r":
                    self.pos += 1
                else:
                    self._structural(ch)

    def _fail(self) -> None:
        self.status = ERROR

    def _value_start(self, ch: str) -> None:
        key = self._keys[-1] if self._stack and self._stack[-1] == "{" else None
        self.events.append(("start", len(self._stack), self.pos, key))
        if ch in "{[":
            if len(self._stack) >= MAX_DEPTH:
                return self._fail()
            self._stack.append(ch)
            self._keys.append(None)
            self._state = _OBJ_FIRST if ch == "{" else _ARR_FIRST
            self.pos += 1
        elif ch == '"':
            self._begin_string(is_key=False)
        elif ch == "-" or ch.isdigit():
            self._state, self._token_start = _NUMBER, self.pos
        elif ch in "tfn":
            self._state, self._token_start = _LITERAL, self.pos
        else:
            self._fail()

    def _value_end(self, end: int) -> None:
        self.events.append(("end", len(self._stack), end, None))
        if not self._stack:
            self.status, self.end = DONE, end
        else:
            self._state = _AFTER

    def _structural(self, ch: str) -> None:
        state = self._state
        if state == _VALUE or (state == _ARR_FIRST and ch != "]"):
            return self._value_start(ch)
        if state in (_OBJ_FIRST, _OBJ_KEY) and ch == '"':
            return self._begin_string(is_key=True)
        if state == _COLON and ch == ":":
            self._state = _VALUE
        elif state == _AFTER and ch == ",":
            self._state = _OBJ_KEY if self._stack[-1] == "{" else _VALUE
        elif ((state in (_OBJ_FIRST, _AFTER) and ch == "}" and self._stack[-1] == "{")
              or (state in (_ARR_FIRST, _AFTER) and ch == "]" and self._stack[-1] == "[")):
            self._stack.pop()
            self._keys.pop()
            self.pos += 1
            return self._value_end(self.pos)
        else:
            return self._fail()
        self.pos += 1

    def _begin_string(self, is_key: bool) -> None:
        self._state, self._is_key, self._token_start = _STRING, is_key, self.pos
        self._escape = 0
        self.pos += 1

    def _string(self, text: str) -> None:
        while self.pos < len(text):
            if self._escape:
                if not self._escape_char(text[self.pos]):
                    return self._fail()
                self.pos += 1
                continue
            m = _STRING_STOP.search(text, self.pos)
            if m is None:
                self.pos = len(text)
                return
            self.pos = m.start() + 1
            ch = m.group()
            if ch == "\\":
                self._escape = 1
            elif ch == '"':
                return self._string_end(text)
            else:
                return self._fail()   # a raw control character: not JSON

    def _escape_char(self, ch: str) -> bool:
        if self._escape == 1:
            if ch == "u":
                self._escape = 5
                return True
            self._escape = 0
            return ch in '"\\/bfnrt'
        self._escape = self._escape - 1 if self._escape > 2 else 0
        return ch in _HEX

    def _string_end(self, text: str) -> None:
        if not self._is_key:
            return self._value_end(self.pos)
        self._keys[-1] = strict_loads(text[self._token_start:self.pos])
        self._state = _COLON

    def _token(self, text: str) -> None:
        start, pos = self._token_start, self.pos
        if self._state == _NUMBER:
            while pos < len(text) and text[pos] in _NUMBER_CHARS:
                pos += 1
        else:
            while pos < len(text) and text[pos].isalpha():
                pos += 1
            if not any(lit.startswith(text[start:pos]) for lit in _LITERALS):
                self.pos = pos
                return self._fail()
        self.pos = pos
        if pos == len(text):
            return   # the token may go on
        word = text[start:pos]
        ok = _NUMBER.fullmatch(word) if self._state == _NUMBER else word in _LITERALS
        if not ok:
            return self._fail()
        self._value_end(pos)


class _Call:
    """Where one call object's members are, as the scanner finds them."""

    def __init__(self) -> None:
        self.name_start = -1
        self.args_start = -1
        self.args_end = -1
        self.member: Optional[str] = None   # "name" / "args": the member being scanned
        self.announced: Optional[PartialCall] = None


class JsonCalls:
    """Call objects in one JSON value: an object, or (``allow_list``) a list of objects.

    A call is announced (appended to ``calls``) once its name is read and accepted by the
    tools; its ``arguments`` then grow with the scanned text of the arguments object.
    ``status`` is PENDING, DONE (``end`` set) or ERROR (bad JSON, unknown tool, no name,
    missing arguments when ``require_args``, arguments that are not an object).
    """

    ARG_KEYS = ("arguments", "parameters")

    def __init__(self, tools: ToolSet, start: int, calls: List[PartialCall],
                 allow_list: bool = False, require_args: bool = False):
        self.tools = tools
        self.scanner = JsonScanner(start)
        self.calls = calls
        self.allow_list = allow_list
        self.require_args = require_args
        self.status = PENDING
        self.end = -1
        self._call_depth = 0
        self._current: Optional[_Call] = None
        self._count = 0

    def read(self, text: str, final: bool) -> str:
        if self.status != PENDING:
            return self.status
        self.scanner.feed(text)
        for kind, depth, pos, key in self.scanner.events:
            if not self._event(text, kind, depth, pos, key):
                self.status = ERROR
                return ERROR
        self.scanner.events.clear()
        if self.scanner.status == ERROR or (final and self.scanner.status == PENDING):
            self.status = ERROR
        elif self.scanner.status == DONE:
            self.status, self.end = (DONE, self.scanner.end) if self._count else (ERROR, -1)
        else:
            self._grow_arguments(text)
        return self.status

    def _event(self, text: str, kind: str, depth: int, pos: int, key: Optional[str]) -> bool:
        if kind == "start" and depth == 0:
            top = text[pos]
            self._call_depth = 1 if top == "[" else 0
            if top == "[" and self.allow_list:
                return True
            if top != "{":
                return False
        if depth == self._call_depth:
            if kind == "start":
                self._current = _Call()
                return text[pos] == "{"
            return self._finish_call(text, pos)
        call = self._current
        if depth != self._call_depth + 1 or call is None:
            return True
        if kind == "start":
            call.member = None
            if key == "name" and call.name_start < 0:
                call.name_start, call.member = pos, "name"
            elif key in self.ARG_KEYS and call.args_start < 0:
                call.args_start, call.member = pos, "args"
                return text[pos] in '{"'
            return True
        member, call.member = call.member, None
        if member == "name":
            return self._announce(text, call, pos)
        if member == "args":
            call.args_end = pos
        return True

    def _announce(self, text: str, call: _Call, end: int) -> bool:
        name = strict_loads(text[call.name_start:end])
        if not isinstance(name, str) or not self.tools.accepts(name):
            return False
        call.announced = PartialCall(name)
        self.calls.append(call.announced)
        return True

    def _finish_call(self, text: str, end: int) -> bool:
        call, self._current = self._current, None
        if call is None or call.announced is None:
            return False
        if call.args_start < 0:
            if self.require_args:
                return False
            arguments = "{}"
        else:
            arguments = text[call.args_start:call.args_end]
            if arguments.startswith('"'):
                arguments = strict_loads(arguments)
            try:
                if not isinstance(strict_loads(arguments), dict):
                    return False
            except (ValueError, RecursionError):
                return False
        if not arguments.startswith(call.announced.arguments):
            return False
        call.announced.arguments = arguments
        self._count += 1
        return True

    def _grow_arguments(self, text: str) -> None:
        call = self._current
        if (call is not None and call.announced is not None and call.args_start >= 0
                and call.args_end < 0 and text[call.args_start] == "{"):
            call.announced.arguments = text[call.args_start:self.scanner.pos]


class JsonArgs:
    """A bare arguments object (``[ARGS]{...}``, DeepSeek's ``{...}``) streamed into
    ``call.arguments`` as it is scanned; ``read`` gives PENDING, DONE (``end`` set) or
    ERROR (not an object, bad JSON, or the text ended inside it)."""

    def __init__(self, start: int, call: PartialCall):
        self.scanner = JsonScanner(start)
        self.call = call
        self.start = -1
        self.end = -1
        self.status = PENDING

    def read(self, text: str, final: bool) -> str:
        if self.status != PENDING:
            return self.status
        scanner = self.scanner
        scanner.feed(text)
        if self.start < 0 and scanner.events:
            self.start = scanner.events[0][2]
            if text[self.start] != "{":
                scanner.status = ERROR
        scanner.events.clear()
        if scanner.status == ERROR or (final and scanner.status == PENDING):
            self.status = ERROR
        elif scanner.status == DONE:
            arguments = text[self.start:scanner.end]
            try:
                ok = isinstance(strict_loads(arguments), dict)
            except (ValueError, RecursionError):
                ok = False
            if ok:
                self.call.arguments, self.end, self.status = arguments, scanner.end, DONE
            else:
                self.status = ERROR
        elif self.start >= 0:
            self.call.arguments = text[self.start:scanner.pos]
        return self.status

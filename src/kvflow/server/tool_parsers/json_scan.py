"""An incremental JSON scanner for model output: the partial value tree of a JSON prefix, and
its canonical text (`json.dumps(value, ensure_ascii=False)` spelling) as far as it is settled.

Why not partial-json-parser alone: it completes a prefix (closes strings, brackets), so the text
of `{"city": "Par` is `{"city": "Par"}`, which the next token contradicts. Streamed tool
arguments must only grow: the canonical text of a prefix here is always a prefix of the
canonical text of any longer prefix (numbers and literals appear once complete, strings grow
by decoded characters, `}`/`]` appear when read). The canonical text of a complete value is
what `json.dumps(json.loads(text), ensure_ascii=False)` gives, so a streamed call assembles to
exactly the non-streamed one. The scanner is lenient where models are sloppy and JSON is not
ambiguous (raw control characters inside strings), and it never raises: invalid input stops
the scan with `broken` set, keeping what was read before.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field

_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")
_NUMBER_CHARS = frozenset("+-.eE0123456789")
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_WS = " \t\n\r"
_LOW = re.compile(r"\\u[dD][c-fC-F][0-9a-fA-F]{2}")
_LOW_PREFIX = re.compile(r"(\\(u[0-9a-fA-F]{0,3})?)?")


@dataclass
class Node:
    """A JSON value read so far. object: items [(key, Node)]; array: items [Node];
    string: text decoded so far; scalar: its canonical text once complete."""

    kind: str
    complete: bool = False
    items: list = field(default_factory=list)
    text: str = ""
    comma: bool = False  # a container: a comma read after its last item
    pending_key: str | None = None  # an object: a key and its colon read, no value yet

    def get(self, *keys: str) -> Node | None:
        """An object's first item under any of `keys` (the first occurrence: it never changes
        as more text is read)."""
        for key, node in self.items:
            if key in keys:
                return node
        return None


def render(node: Node | None) -> str:
    """The canonical text of what `node` holds so far (see the module docstring)."""
    if node is None:
        return ""
    if node.kind == "string":
        return '"' + _escape(node.text) + ('"' if node.complete else "")
    if node.kind == "scalar":
        return node.text if node.complete else ""
    if node.kind == "object":
        parts = [f'"{_escape(k)}": {render(v)}' for k, v in node.items]
        tail = f'"{_escape(node.pending_key)}": ' if node.pending_key is not None else ""
        close = "}" if node.complete else ""
        return "{" + ", ".join(parts) + (", " if node.comma else "") + tail + close
    parts = [render(v) for v in node.items]
    return "[" + ", ".join(parts) + (", " if node.comma else "") + ("]" if node.complete else "")


def _escape(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)[1:-1]


@dataclass
class Scan:
    """One JSON value scanned from a position: its tree (None if it has not started), the index
    after it when complete, and whether invalid text stopped the scan."""

    node: Node | None
    end: int | None
    broken: bool


def scan(text: str, pos: int = 0) -> Scan:
    """Scan the JSON value at text[pos:] (leading whitespace skipped); never raises."""
    holder: list[Node] = []
    parser = _Parser(text)
    try:
        end = parser.value(parser.ws(pos), holder.append)
    except _Stop as stop:
        return Scan(holder[0] if holder else None, None, stop.broken)
    except RecursionError:
        return Scan(holder[0] if holder else None, None, True)
    return Scan(holder[0], end, False)


def skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _WS:
        pos += 1
    return pos


class _Stop(Exception):
    def __init__(self, broken: bool) -> None:
        self.broken = broken


class _Parser:
    def __init__(self, text: str) -> None:
        self.text = text

    def ws(self, i: int) -> int:
        return skip_ws(self.text, i)

    def peek(self, i: int) -> str:
        if i >= len(self.text):
            raise _Stop(False)
        return self.text[i]

    def value(self, i: int, attach: Callable[[Node], None]) -> int:
        c = self.peek(i)
        if c == "{":
            return self.container(i, attach, Node("object"), "}")
        if c == "[":
            return self.container(i, attach, Node("array"), "]")
        if c == '"':
            node = Node("string")
            attach(node)
            end = self.string(i, node)
            node.complete = True
            return end
        node = Node("scalar")
        attach(node)
        end = self.number(i, node) if c == "-" or c.isdigit() else self.literal(i, node)
        node.complete = True
        return end

    def container(self, i: int, attach: Callable[[Node], None], node: Node, close: str) -> int:
        attach(node)
        i = self.ws(i + 1)
        if self.peek(i) == close:
            node.complete = True
            return i + 1
        while True:
            i = self.object_item(i, node) if close == "}" else self.array_item(i, node)
            i = self.ws(i)
            c = self.peek(i)
            if c == close:
                node.complete = True
                return i + 1
            if c != ",":
                raise _Stop(True)
            node.comma = True
            i = self.ws(i + 1)

    def array_item(self, i: int, node: Node) -> int:
        def attach(child: Node) -> None:
            node.items.append(child)
            node.comma = False

        return self.value(i, attach)

    def object_item(self, i: int, node: Node) -> int:
        if self.peek(i) != '"':
            raise _Stop(True)
        key = Node("string")
        i = self.ws(self.string(i, key))
        if self.peek(i) != ":":
            raise _Stop(True)
        node.pending_key = key.text
        i = self.ws(i + 1)

        def attach(child: Node) -> None:
            node.items.append((key.text, child))
            node.pending_key = None
            node.comma = False

        return self.value(i, attach)

    def string(self, i: int, node: Node) -> int:
        """Decode the string at text[i] (a quote) into node.text as it goes; returns the index
        after its closing quote."""
        text, n = self.text, len(self.text)
        buf: list[str] = []
        i += 1
        try:
            while True:
                if i >= n:
                    raise _Stop(False)
                c = text[i]
                if c == '"':
                    return i + 1
                if c != "\\":
                    buf.append(c)
                    i += 1
                    continue
                char, i = self.escape(i)
                buf.append(char)
        finally:
            node.text = "".join(buf)

    def escape(self, i: int) -> tuple[str, int]:
        """The character of the escape at text[i] (a backslash) and the index after it; a
        surrogate pair is one character, a lone surrogate U+FFFD."""
        text = self.text
        c = self.peek(i + 1)
        if c in _ESCAPES:
            return _ESCAPES[c], i + 2
        if c != "u":
            raise _Stop(True)
        code = self.hex4(i + 2)
        if 0xD800 <= code < 0xDC00:
            rest = text[i + 6 : i + 12]
            if len(rest) < 6 and _LOW_PREFIX.fullmatch(rest):
                raise _Stop(False)  # the low half may follow: wait for it
            if _LOW.fullmatch(rest):
                low = int(rest[2:], 16)
                return chr(0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00)), i + 12
            return "\ufffd", i + 6
        if 0xDC00 <= code < 0xE000:
            return "\ufffd", i + 6
        return chr(code), i + 6

    def hex4(self, i: int) -> int:
        digits = self.text[i : i + 4]
        if not all(d in "0123456789abcdefABCDEF" for d in digits):
            raise _Stop(True)
        if len(digits) < 4:
            raise _Stop(False)
        return int(digits, 16)

    def number(self, i: int, node: Node) -> int:
        j = i
        while j < len(self.text) and self.text[j] in _NUMBER_CHARS:
            j += 1
        if j >= len(self.text):
            raise _Stop(False)  # more digits may follow
        raw = self.text[i:j]
        if not _NUMBER.fullmatch(raw):
            raise _Stop(True)
        value = json.loads(raw)
        finite = not isinstance(value, float) or math.isfinite(value)
        node.text = json.dumps(value) if finite else raw
        return j

    def literal(self, i: int, node: Node) -> int:
        rest = self.text[i : i + 5]
        for word in ("true", "false", "null"):
            if rest.startswith(word):
                node.text = word
                return i + len(word)
            if word.startswith(rest):
                raise _Stop(False)
        raise _Stop(True)

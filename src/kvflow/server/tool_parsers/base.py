"""What every tool-call parser shares: the parse result, the call drafts read from JSON, the
content rules, and the two ways a parse is used (a whole output, a growing stream).

A parser's `parse(text, final)` reads the model's output so far and returns its content and
the calls in it. The contract that makes streaming equal non-streaming: for a prefix `a` of
`b`, `parse(a, False)` is a prefix of `parse(b, final)` (its content a prefix of the content;
the same calls with the same names, each call's arguments a prefix of the later arguments, and
maybe more calls after). A stream then sends differences only, and what a client assembles is
the parse of the whole output. A parser never raises: text that is not a call is content.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from kvflow.server.tool_parsers.json_scan import Node, render, scan


@dataclass
class CallDraft:
    """A call as read so far: its complete name and its arguments' canonical JSON prefix."""

    name: str
    arguments: str


@dataclass
class Parsed:
    content: str = ""
    calls: list[CallDraft] = field(default_factory=list)


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


class ToolParser:
    """A format of tool calls in model output (see the module docstring)."""

    name = ""
    # the format's markers are special tokens: the detokenizer must keep them
    keeps_special_tokens = False

    def parse(self, text: str, final: bool) -> Parsed:
        raise NotImplementedError


def settle(parsed: Parsed, final: bool, limit: int | None = None) -> Parsed:
    """The content and calls a client sees: trailing whitespace is held back until more text
    follows, and dropped at the end when there are calls; `limit` keeps the first calls."""
    content = parsed.content
    if not final or parsed.calls:
        content = content.rstrip()
    calls = parsed.calls if limit is None else parsed.calls[:limit]
    return Parsed(content, calls)


def extract(parser: ToolParser, text: str, limit: int | None = None) -> tuple[str, list[dict]]:
    """A whole output: (content, tool calls in OpenAI's shape)."""
    parsed = settle(_safe_parse(parser, text, True), True, limit)
    calls = [
        {
            "id": new_call_id(),
            "type": "function",
            "function": {"name": c.name, "arguments": c.arguments},
        }
        for c in parsed.calls
    ]
    return parsed.content, calls


class ToolStream:
    """A growing output: each `step` returns the new content and OpenAI's tool-call deltas
    (a call's first delta carries its index, id, type, name and the arguments so far; later
    ones the index and the new argument text)."""

    def __init__(self, parser: ToolParser, limit: int | None = None) -> None:
        self.parser = parser
        self.limit = limit
        self.sent_content = 0
        self.sent_args: list[int] = []

    @property
    def called(self) -> bool:
        return bool(self.sent_args)

    def step(self, text: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        parsed = settle(_safe_parse(self.parser, text, final), final, self.limit)
        content = parsed.content[self.sent_content :]
        self.sent_content = max(self.sent_content, len(parsed.content))
        deltas: list[dict[str, Any]] = []
        for index, call in enumerate(parsed.calls):
            if index == len(self.sent_args):
                self.sent_args.append(len(call.arguments))
                function = {"name": call.name, "arguments": call.arguments}
                deltas.append(
                    {"index": index, "id": new_call_id(), "type": "function", "function": function}
                )
            elif len(call.arguments) > self.sent_args[index]:
                new = call.arguments[self.sent_args[index] :]
                self.sent_args[index] = len(call.arguments)
                deltas.append({"index": index, "function": {"arguments": new}})
        return content, deltas


def _safe_parse(parser: ToolParser, text: str, final: bool) -> Parsed:
    """A bug in a parser must not fail the request: its output is then plain content."""
    try:
        return parser.parse(text, final)
    except Exception:  # a parser never raises (DESIGN: model output is data)
        return Parsed(text if final else "")


# ---- JSON calls --------------------------------------------------------------------------------

ARGUMENT_KEYS = ("arguments", "parameters")


def call_of(node: Node | None, keys: tuple[str, ...] = ARGUMENT_KEYS) -> CallDraft | None:
    """`{"name": ..., "arguments" | "parameters": ...}` read so far: a draft once the name is
    complete. Arguments given as a string (JSON text in a string) are that text."""
    if node is None or node.kind != "object":
        return None
    name = node.get("name")
    if name is None or name.kind != "string" or not name.complete:
        return None
    args = node.get(*keys)
    if args is None:
        text = "{}" if node.complete else ""
    elif args.kind == "string":
        text = args.text
    else:
        text = render(args)
    return CallDraft(name.text, text)


def calls_of(node: Node | None, keys: tuple[str, ...] = ARGUMENT_KEYS) -> list[CallDraft]:
    """The calls of one call object or of a list of them, up to the first item that is not
    (yet) a call."""
    if node is None:
        return []
    if node.kind != "array":
        call = call_of(node, keys)
        return [] if call is None else [call]
    calls = []
    for item in node.items:
        call = call_of(item, keys)
        if call is None:
            break
        calls.append(call)
    return calls


@dataclass
class Region:
    """The calls read from a stretch of output, and whether it is settled as plain text (it
    can no longer hold a call) or undecided (not a call yet, but it may become one)."""

    calls: list[CallDraft]
    is_text: bool
    end: int | None = None  # where the JSON value ended, when it did
    empty: bool = False  # an empty list: no calls and nothing to show (a model's "no call")


def json_region(text: str, closed: bool) -> Region:
    """A stretch that should hold one JSON call object or a list of them; `closed`: no more
    text will come into it."""
    result = scan(text)
    node = result.node
    if node is not None and node.kind == "array" and node.complete and not node.items:
        return Region([], False, result.end, empty=True)
    calls = calls_of(node)
    is_text = not calls and (result.broken or closed or _not_a_call(node))
    return Region(calls, is_text, result.end)


def _not_a_call(node: Node | None) -> bool:
    """A complete value that holds no call, a scalar, or a list whose first item is one of
    those: no more text makes it a call."""
    if node is None:
        return False
    if node.complete or node.kind in ("string", "scalar"):
        return True
    return node.kind == "array" and bool(node.items) and _not_a_call(node.items[0])


def parse_tagged(text: str, final: bool, start: str, end: str) -> Parsed:
    """Calls in `start` ... `end` stretches (the last may be cut off), content around them. A
    stretch that holds no call is content, its markers dropped."""
    out = Parsed()
    i = 0
    while True:
        j = text.find(start, i)
        if j < 0:
            tail = text[i:]
            out.content += tail if final else hold_partial(tail, start)
            return out
        out.content += text[i:j]
        body_start = j + len(start)
        k = text.find(end, body_start)
        body = text[body_start : k if k >= 0 else len(text)]
        region = json_region(body, closed=k >= 0 or final)
        if region.calls:
            out.calls += region.calls
        elif region.is_text:
            out.content += body if k >= 0 or final else hold_partial(body, end)
        elif not region.empty:
            return out  # undecided: nothing after it is read yet
        if k < 0:
            return out
        i = k + len(end)


def hold_partial(text: str, marker: str) -> str:
    """`text` less a tail that could begin `marker` (held back until the next text says)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return text[:-k]
    return text

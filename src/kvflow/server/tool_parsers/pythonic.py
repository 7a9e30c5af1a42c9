"""pythonic: a Python list of calls with keyword arguments, `[get_weather(city="Paris"),
now()]` (Llama 3.2 / 4 and others). The output is calls or text as a whole: it must start
with `[`. Argument values are Python literals (JSON's true/false/null too); a call's
arguments grow by whole keyword arguments."""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from kvflow.server.tool_parsers.base import CallDraft, Parsed, ToolParser
from kvflow.server.tool_parsers.json_scan import skip_ws

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*")
_NAMES = {"true": True, "false": False, "null": None, "True": True, "False": False, "None": None}


class _Stop(Exception):
    def __init__(self, broken: bool) -> None:
        self.broken = broken


class PythonicToolParser(ToolParser):
    name = "pythonic"

    def parse(self, text: str, final: bool) -> Parsed:
        s = skip_ws(text, 0)
        if s >= len(text) or text[s] != "[":
            return Parsed(text)
        calls: list[CallDraft] = []
        broken = False
        try:
            _Calls(text, calls).read(s + 1)
        except _Stop as stop:
            broken = stop.broken
        except (RecursionError, ValueError):
            broken = True
        if calls:
            return Parsed("", calls)
        return Parsed(text if broken or final else "")


class _Calls:
    def __init__(self, text: str, calls: list[CallDraft]) -> None:
        self.text = text
        self.calls = calls

    def at(self, i: int) -> str:
        if i >= len(self.text):
            raise _Stop(False)
        return self.text[i]

    def ident(self, i: int) -> tuple[str, int]:
        match = _IDENT.match(self.text, i)
        if match is None:
            self.at(i)
            raise _Stop(True)
        if match.end() >= len(self.text):
            raise _Stop(False)  # the name may go on
        return match.group(), match.end()

    def read(self, i: int) -> None:
        while True:
            i = skip_ws(self.text, i)
            name, i = self.ident(i)
            i = skip_ws(self.text, i)
            if self.at(i) != "(":
                raise _Stop(True)
            call = CallDraft(name, "{")
            self.calls.append(call)
            i = self.arguments(skip_ws(self.text, i + 1), call)
            i = skip_ws(self.text, i)
            c = self.at(i)
            if c == "]":
                return
            if c != ",":
                raise _Stop(True)
            i += 1

    def arguments(self, i: int, call: CallDraft) -> int:
        first = True
        while True:
            if self.at(i) == ")":
                call.arguments += "}"
                return i + 1
            key, i = self.ident(i)
            i = skip_ws(self.text, i)
            if self.at(i) != "=":
                raise _Stop(True)
            end = _literal_end(self.text, skip_ws(self.text, i + 1))
            value = _literal(self.text[i + 1 : end])
            sep = "" if first else ", "
            call.arguments += f"{sep}{json.dumps(key)}: {value}"
            first = False
            i = skip_ws(self.text, end)
            if self.at(i) == ",":
                i = skip_ws(self.text, i + 1)


def _literal_end(text: str, i: int) -> int:
    """The index of the `,` or `)` that ends the literal at text[i] (brackets and quotes
    balanced); _Stop(False) while the text ends first."""
    depth, quote = 0, ""
    while i < len(text):
        c = text[i]
        if quote:
            if c == "\\":
                i += 1
            elif c == quote:
                quote = ""
        elif c in "\"'":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in "}])":
            if depth == 0:
                if c == ")":
                    return i
                raise _Stop(True)
            depth -= 1
        elif c == "," and depth == 0:
            return i
        i += 1
    raise _Stop(False)


def _literal(source: str) -> str:
    """A Python literal's canonical JSON text; _Stop(True) for anything else."""
    try:
        value = _value(ast.parse(source.strip(), mode="eval").body)
        return json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (SyntaxError, ValueError, TypeError) as exc:
        raise _Stop(True) from exc


def _value(node: ast.expr) -> Any:
    if isinstance(node, ast.Constant) and not isinstance(node.value, bytes | complex):
        return node.value
    if isinstance(node, ast.Name) and node.id in _NAMES:
        return _NAMES[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        inner = _value(node.operand)
        if isinstance(inner, int | float) and not isinstance(inner, bool):
            return -inner if isinstance(node.op, ast.USub) else inner
    if isinstance(node, ast.List | ast.Tuple):
        return [_value(e) for e in node.elts]
    if isinstance(node, ast.Dict) and all(k is not None for k in node.keys):
        return {str(_value(k)): _value(v) for k, v in zip(node.keys, node.values, strict=True)}
    raise ValueError("not a literal")

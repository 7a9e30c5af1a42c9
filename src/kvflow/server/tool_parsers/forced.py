"""The outputs of `tool_choice` "required" and named, which the grammar shapes (as vLLM's):
required is a JSON list of `{"name": ..., "parameters": {...}}`; named is the one function's
arguments object alone."""

from __future__ import annotations

from kvflow.server.tool_parsers.base import CallDraft, Parsed, ToolParser, json_region
from kvflow.server.tool_parsers.json_scan import render, scan


class RequiredToolParser(ToolParser):
    name = "required"

    def parse(self, text: str, final: bool) -> Parsed:
        region = json_region(text, closed=final)
        if region.calls:
            return Parsed("", region.calls)
        return Parsed(text if region.is_text else "")


class NamedToolParser(ToolParser):
    name = "named"

    def __init__(self, function: str) -> None:
        self.function = function

    def parse(self, text: str, final: bool) -> Parsed:
        return Parsed("", [CallDraft(self.function, render(scan(text).node))])

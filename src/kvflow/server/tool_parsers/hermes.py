"""hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one call a stretch,
content before and between (Hermes 2 Pro/3, Qwen2.5, Qwen3)."""

from __future__ import annotations

from kvflow.server.tool_parsers.base import Parsed, ToolParser, parse_tagged

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"

    def parse(self, text: str, final: bool) -> Parsed:
        return parse_tagged(text, final, START, END)

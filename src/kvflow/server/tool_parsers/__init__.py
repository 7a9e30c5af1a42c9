"""Tool-call parsers by `--tool-call-parser` name (vLLM's names), imported on first use."""

from __future__ import annotations

import importlib

from kvflow.server.tool_parsers.base import ToolParser

# name -> module:class; llama4_json is vLLM's second name for the same format
_PARSERS = {
    "hermes": "hermes:HermesToolParser",
    "llama3_json": "llama3_json:Llama3JsonToolParser",
    "llama4_json": "llama3_json:Llama3JsonToolParser",
    "mistral": "mistral:MistralToolParser",
    "pythonic": "pythonic:PythonicToolParser",
    "xlam": "xlam:XlamToolParser",
}
TOOL_PARSER_NAMES = tuple(_PARSERS)


def get_tool_parser(name: str) -> ToolParser:
    """A fresh parser (parsers hold no state, but a caller may keep one per request)."""
    try:
        target = _PARSERS[name]
    except KeyError:
        known = ", ".join(TOOL_PARSER_NAMES)
        raise ValueError(f"unknown tool call parser {name!r}; known: {known}") from None
    module, cls = target.split(":")
    return getattr(importlib.import_module(f"kvflow.server.tool_parsers.{module}"), cls)()


__all__ = ["TOOL_PARSER_NAMES", "ToolParser", "get_tool_parser"]

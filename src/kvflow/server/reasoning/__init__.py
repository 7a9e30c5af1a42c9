"""Reasoning parsers by `--reasoning-parser` name (vLLM's names)."""

from __future__ import annotations

from typing import Any

from kvflow.server.reasoning.think import DeepSeekR1ReasoningParser, Qwen3ReasoningParser

_PARSERS = {"deepseek_r1": DeepSeekR1ReasoningParser, "qwen3": Qwen3ReasoningParser}
REASONING_PARSER_NAMES = tuple(_PARSERS)


def get_reasoning_parser(
    name: str, chat_template_kwargs: dict[str, Any] | None = None
) -> DeepSeekR1ReasoningParser:
    """The parser for one request (the template's kwargs say whether it thinks at all)."""
    try:
        cls = _PARSERS[name]
    except KeyError:
        known = ", ".join(REASONING_PARSER_NAMES)
        raise ValueError(f"unknown reasoning parser {name!r}; known: {known}") from None
    return cls(chat_template_kwargs or {})


__all__ = ["REASONING_PARSER_NAMES", "get_reasoning_parser"]

"""`<think>...</think>` reasoning: the text before `</think>` is the reasoning, the rest the
answer. The opening tag is usually in the prompt (the template writes it), so the output may
start with the reasoning itself; a leading `<think>` the model writes is dropped.

`split(text, final)` follows the tool parsers' contract: for a prefix of the output, both parts
are prefixes of what a longer output gives (a tail that may begin `</think>` waits), so a
stream's deltas assemble to the whole output's split.
"""

from __future__ import annotations

from typing import Any

from kvflow.server.tool_parsers.base import hold_partial
from kvflow.server.tool_parsers.json_scan import skip_ws

START, END = "<think>", "</think>"


class DeepSeekR1ReasoningParser:
    """deepseek_r1: without `</think>` the whole output is reasoning (it was cut off)."""

    name = "deepseek_r1"
    end_text = END

    def __init__(self, chat_template_kwargs: dict[str, Any]) -> None:
        self.thinking = True

    def split(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning, content) of the output so far."""
        if not self.thinking:
            return "", text
        s = skip_ws(text, 0)
        if text.startswith(START, s):
            text = text[s + len(START) :]
        elif not final and s < len(text) and START.startswith(text[s:]):
            return "", ""  # perhaps the opening tag
        end = text.find(END)
        if end >= 0:
            return text[:end], text[end + len(END) :]
        return (text if final else hold_partial(text, END)), ""


class Qwen3ReasoningParser(DeepSeekR1ReasoningParser):
    """qwen3: as deepseek_r1, but `chat_template_kwargs={"enable_thinking": false}` (the
    template then closes the reasoning in the prompt) makes the whole output the answer."""

    name = "qwen3"

    def __init__(self, chat_template_kwargs: dict[str, Any]) -> None:
        self.thinking = chat_template_kwargs.get("enable_thinking", True) is not False

"""One chat choice's text turned into what the response carries: reasoning, content and tool
calls, for a whole output and for a stream (the same parse, so they agree).

The reasoning parser (if any) splits the text first; the tool parser (if any) reads the answer
part. Without either, the text is the content unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvflow.server.reasoning.think import DeepSeekR1ReasoningParser
from kvflow.server.tool_parsers.base import ToolParser, ToolStream


@dataclass
class ChoiceDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


@dataclass
class ChoiceMessage:
    reasoning: str | None
    content: str | None
    tool_calls: list[dict[str, Any]]


class ChoiceParser:
    """Feeds one choice's text deltas through the parsers; `step` returns what is new."""

    def __init__(
        self,
        reasoning: DeepSeekR1ReasoningParser | None,
        tools: ToolParser | None,
        limit: int | None = None,
        include_reasoning: bool = True,
    ) -> None:
        self.reasoning = reasoning
        self.tools = None if tools is None else ToolStream(tools, limit)
        self.include_reasoning = include_reasoning
        self.text = ""
        self.sent_reasoning = 0
        self.sent_content = 0
        self.all = ChoiceDelta()

    @property
    def called(self) -> bool:
        return self.tools is not None and self.tools.called

    def step(self, delta_text: str, final: bool) -> ChoiceDelta:
        self.text += delta_text
        if self.reasoning is None:
            reasoning, answer = "", self.text
        else:
            reasoning, answer = self.reasoning.split(self.text, final)
        out = ChoiceDelta()
        if self.include_reasoning:
            out.reasoning = reasoning[self.sent_reasoning :]
            self.sent_reasoning = max(self.sent_reasoning, len(reasoning))
        if self.tools is not None:
            out.content, out.tool_calls = self.tools.step(answer, final)
        else:
            out.content = answer[self.sent_content :]
            self.sent_content = max(self.sent_content, len(answer))
        self.all.reasoning += out.reasoning
        self.all.content += out.content
        self.all.tool_calls += out.tool_calls
        return out

    def message(self) -> ChoiceMessage:
        """Everything `step` returned, as one message: content None when there are calls (or
        reasoning) and no answer text; the calls' deltas folded into whole calls."""
        calls: list[dict[str, Any]] = []
        for delta in self.all.tool_calls:
            if delta["index"] == len(calls):
                calls.append({**delta, "function": dict(delta["function"])})
            else:
                calls[delta["index"]]["function"]["arguments"] += delta["function"]["arguments"]
        for call in calls:
            del call["index"]
        parsed = self.tools is not None or self.reasoning is not None
        content = self.all.content
        empty = not content and (calls or self.all.reasoning)
        return ChoiceMessage(
            reasoning=self.all.reasoning or None,
            content=None if parsed and empty else content,
            tool_calls=calls,
        )

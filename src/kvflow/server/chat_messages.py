"""Request chat messages as chat templates read them (vLLM's conventions); what cannot be
read is a ValueError (the caller's 400)."""

from __future__ import annotations

import json
from typing import Any


def template_message(m: Any) -> dict[str, Any]:
    """A request message as templates read it: text content, and an assistant's tool calls
    with their arguments as objects (vLLM's convention; JSON text that is not an object
    stays text) and a tool result's call id."""
    content = m.content
    if isinstance(content, list):
        parts = []
        for part in content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("Only text content parts are supported.")
            parts.append(part["text"])
        content = "\n".join(parts)
    message: dict[str, Any] = {"role": m.role, "content": content or ""}
    if m.name is not None:
        message["name"] = m.name
    if m.tool_call_id is not None:
        message["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        message["tool_calls"] = [_template_call(call) for call in m.tool_calls]
    return message


def _template_call(call: Any) -> dict[str, Any]:
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise ValueError(
            'Each tool call must be {"id": ..., "type": "function", "function": {"name": ..., '
            '"arguments": ...}}.'
        )
    function = dict(call["function"])
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict):
            function["arguments"] = parsed
    return {**call, "function": function}

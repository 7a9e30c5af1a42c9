"""llama3_json: Llama 3.1/3.2's JSON calls, `{"name": ..., "parameters": {...}}` (or
"arguments"), optionally after `<|python_tag|>`, several separated by `;`. The output is
calls or text as a whole, as in vLLM: it must start with one."""

from __future__ import annotations

from kvflow.server.tool_parsers.base import CallDraft, Parsed, ToolParser, call_of
from kvflow.server.tool_parsers.json_scan import scan, skip_ws

TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def parse(self, text: str, final: bool) -> Parsed:
        s = skip_ws(text, 0)
        if text.startswith(TAG, s):
            s = skip_ws(text, s + len(TAG))
        elif not final and s < len(text) and TAG.startswith(text[s:]):
            return Parsed()  # perhaps the tag
        if s >= len(text) or text[s] != "{":
            return Parsed(text.replace(TAG, "", 1))
        calls: list[CallDraft] = []
        while True:
            result = scan(text, s)
            call = call_of(result.node)
            if call is None:
                settled = result.broken or final or (result.node and result.node.complete)
                return Parsed(text.replace(TAG, "", 1) if settled and not calls else "", calls)
            calls.append(call)
            if result.end is None:
                return Parsed("", calls)
            s = skip_ws(text, result.end)
            if not text.startswith(";", s):
                return Parsed("", calls)
            s = skip_ws(text, s + 1)

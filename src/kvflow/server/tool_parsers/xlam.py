"""xlam: a JSON list of `{"name": ..., "arguments": {...}}` calls, bare at the start of the
output or inside `<tool_call>...</tool_call>` (a single object there too). SmolLM2-Instruct,
the embedded model, was trained on this format: `<tool_call>[{...}, ...]</tool_call>`; vLLM's
parser for it is `xlam` (Salesforce xLAM), which reads the same shapes."""

from __future__ import annotations

from kvflow.server.tool_parsers.base import Parsed, ToolParser, json_region, parse_tagged
from kvflow.server.tool_parsers.json_scan import skip_ws

START, END = "<tool_call>", "</tool_call>"


class XlamToolParser(ToolParser):
    name = "xlam"

    def parse(self, text: str, final: bool) -> Parsed:
        s = skip_ws(text, 0)
        if s < len(text) and text[s] == "[":
            region = json_region(text[s:], closed=final)
            if region.calls:
                return Parsed("", region.calls)
            return Parsed(text if region.is_text and not region.empty else "")
        return parse_tagged(text, final, START, END)

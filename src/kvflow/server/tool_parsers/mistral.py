"""mistral: `[TOOL_CALLS]` then a JSON list of `{"name", "arguments"}` calls (tokenizers up
to v7), or `[TOOL_CALLS]name[ARGS]{...}` per call (v11+). Content comes before the first
marker. The markers are special tokens, so the detokenizer keeps special tokens."""

from __future__ import annotations

import re

from kvflow.server.tool_parsers.base import (
    CallDraft,
    Parsed,
    Region,
    ToolParser,
    hold_partial,
    json_region,
)
from kvflow.server.tool_parsers.json_scan import render, scan, skip_ws

MARK, ARGS = "[TOOL_CALLS]", "[ARGS]"
_NAME = re.compile(r"[A-Za-z0-9_.\-]+")


class MistralToolParser(ToolParser):
    name = "mistral"
    keeps_special_tokens = True

    def parse(self, text: str, final: bool) -> Parsed:
        j = text.find(MARK)
        if j < 0:
            return Parsed(text if final else hold_partial(text, MARK))
        out = Parsed(text[:j])
        i = j + len(MARK)
        while True:
            nxt = text.find(MARK, i)
            closed = nxt >= 0 or final
            body = text[i : nxt if nxt >= 0 else len(text)]
            region = _body(body, closed)
            if region.calls:
                out.calls += region.calls
            elif region.is_text:
                out.content += body if closed else hold_partial(body, MARK)
            else:
                return out
            if nxt < 0:
                return out
            i = nxt + len(MARK)


def _body(body: str, closed: bool) -> Region:
    s = skip_ws(body, 0)
    if s < len(body) and body[s] in "[{":
        return json_region(body[s:], closed)
    a = body.find(ARGS, s)
    if a < 0:
        name = hold_partial(body[s:], ARGS)
        undecided = not closed and (name == "" or _NAME.fullmatch(name))
        return Region([], not undecided)
    name = body[s:a].strip()
    if not _NAME.fullmatch(name):
        return Region([], True)
    return Region([CallDraft(name, render(scan(body, a + len(ARGS)).node))], False)

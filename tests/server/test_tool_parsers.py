"""Each tool-call parser on recorded outputs of its format (well-formed, malformed, cut off):
the whole-output extraction, and the stream fed at every split point and token by token,
whose assembled calls must equal the whole-output ones."""

from __future__ import annotations

import json

import pytest

from kvflow.server.tool_parsers import TOOL_PARSER_NAMES, get_tool_parser
from kvflow.server.tool_parsers.base import ToolStream, extract
from kvflow.server.tool_parsers.forced import NamedToolParser, RequiredToolParser
from kvflow.server.tool_parsers.json_scan import render, scan

W = {"city": "Paris", "unit": "celsius"}
WJ = json.dumps(W)

# (parser, model output, expected content, expected [(name, arguments dict | raw text)])
CASES = [
    # hermes (Qwen2.5 / Hermes 3)
    ("hermes", f'<tool_call>\n{{"name": "get_weather", "arguments": {WJ}}}\n</tool_call>',
     None, [("get_weather", W)]),
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n'
     '<tool_call>\n{"name": "b", "arguments": {"x": [1, 2.0, "\\u00e9"]}}\n</tool_call>',
     "Let me check.", [("a", {}), ("b", {"x": [1, 2.0, "é"]})]),
    ("hermes", "The capital of France is Paris.", "The capital of France is Paris.", []),
    ("hermes", "a < b and <tool_ is not a tag", "a < b and <tool_ is not a tag", []),
    ("hermes", "<tool_call>not json at all</tool_call> ok", "not json at all ok", []),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "Par',  # cut off
     None, [("get_weather", '{"city": "Par')]),
    ("hermes", '<tool_call>{"name": "get_wea', '{"name": "get_wea', []),  # cut before the name
    ("hermes", '<tool_call>{"arguments": {"q": 1}, "name": "search"}</tool_call>',
     None, [("search", {"q": 1})]),
    ("hermes", '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>',
     None, [("f", '{"a": 1}')]),  # arguments as JSON text in a string
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": 1}} trailing junk</tool_call>',
     None, [("f", {"a": 1})]),
    # xlam: the embedded SmolLM2's format
    ("xlam", f'<tool_call>[{{"name": "get_weather", "arguments": {WJ}}}]</tool_call>',
     None, [("get_weather", W)]),
    ("xlam", '<tool_call>[\n{"name": "a", "arguments": {"n": 1}},\n{"name": "b", "arguments":'
     ' {"s": "x\\ny"}}\n]</tool_call>', None, [("a", {"n": 1}), ("b", {"s": "x\ny"})]),
    ("xlam", '[{"name": "a", "arguments": {"n": -1.5e1}}]', None, [("a", {"n": -15.0})]),
    ("xlam", '<tool_call>{"name": "a", "arguments": {}}</tool_call>', None, [("a", {})]),
    ("xlam", "[1] is a citation, not a call.", "[1] is a citation, not a call.", []),
    ("xlam", "<tool_call>[]</tool_call>", None, []),  # the template's "no call needed"
    ("xlam", "[]", None, []),
    ("xlam", '<tool_call>[{"name": "a", "arguments": {"n": 1}}, {"name"', None,
     [("a", {"n": 1})]),
    ("xlam", "I cannot help with that.", "I cannot help with that.", []),
    # llama3_json (Llama 3.1 / 3.2)
    ("llama3_json", f'{{"name": "get_weather", "parameters": {WJ}}}', None,
     [("get_weather", W)]),
    ("llama3_json", '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters":'
     ' {"k": true}}', None, [("a", {}), ("b", {"k": True})]),
    ("llama3_json", "Paris is the capital.", "Paris is the capital.", []),
    ("llama3_json", '{"city": "Paris"}', '{"city": "Paris"}', []),
    ("llama3_json", '{"name": "a", "parameters": {"x": nope}}', None, [("a", '{"x": ')]),
    # mistral, both generations
    ("mistral", f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {WJ}}}]', None,
     [("get_weather", W)]),
    ("mistral", f"Sure. [TOOL_CALLS]get_weather[ARGS]{WJ}[TOOL_CALLS]now[ARGS]{{}}", "Sure.",
     [("get_weather", W), ("now", {})]),
    ("mistral", "[TOOL_CALLS]bad name![ARGS]{}", "bad name![ARGS]{}", []),
    ("mistral", "No tools needed.", "No tools needed.", []),
    # pythonic (Llama 3.2 / 4)
    ("pythonic", '[get_weather(city="Paris", unit=\'celsius\')]', None, [("get_weather", W)]),
    ("pythonic", "[a(), b.c(x=[1, 2], y={'k': None}, z=-3, t=true)]", None,
     [("a", {}), ("b.c", {"x": [1, 2], "y": {"k": None}, "z": -3, "t": True})]),
    ("pythonic", "[see the docs] for more", "[see the docs] for more", []),
    ("pythonic", "[f(x=open('y'))]", None, [("f", "{")]),
    ("pythonic", '[get_weather(city="Pa', None, [("get_weather", "{")]),
    ("pythonic", "Plain answer.", "Plain answer.", []),
]  # fmt: skip


def _expected_args(args) -> str:
    return args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


def _assemble(parser, pieces: list[str]) -> tuple[str | None, list[dict]]:
    """Feed the pieces as a stream and assemble as the openai client does."""
    stream = ToolStream(parser)
    text, content, calls = "", None, []
    for k, piece in enumerate(pieces):
        text += piece
        new, deltas = stream.step(text, k == len(pieces) - 1)
        if new:
            content = (content or "") + new
        for delta in deltas:
            if delta["index"] == len(calls):
                assert delta["id"] and delta["type"] == "function" and delta["function"]["name"]
                calls.append({"name": delta["function"]["name"], "arguments": ""})
            else:
                assert "name" not in delta["function"] and "id" not in delta
            calls[delta["index"]]["arguments"] += delta["function"]["arguments"]
    return content, calls


@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_whole_output_and_every_stream_split_agree(name, text, content, calls):
    parser = get_tool_parser(name)
    got_content, got_calls = extract(parser, text)
    want = [{"name": n, "arguments": _expected_args(a)} for n, a in calls]
    assert [c["function"] for c in got_calls] == want
    assert all(c["type"] == "function" and c["id"].startswith("chatcmpl-tool-") for c in got_calls)
    assert (got_content or None) == content
    for cut in range(len(text) + 1):
        streamed = _assemble(parser, [text[:cut], text[cut:]])
        assert streamed == (content, want), cut
    assert _assemble(parser, list(text)) == (content, want)


def test_streamed_content_never_shows_a_marker():
    for name, marker in (("hermes", "<tool_call>"), ("xlam", "<tool_call>"),
                         ("mistral", "[TOOL_CALLS]")):  # fmt: skip
        parser = get_tool_parser(name)
        text = f'Hello {marker}{{"name": "f", "arguments": {{"a": 1}}}}'
        stream, shown = ToolStream(parser), ""
        for k in range(1, len(text) + 1):
            shown += stream.step(text[:k], k == len(text))[0]
            assert "<" not in shown and "[" not in shown, (name, shown)
        assert shown == "Hello"


def test_parallel_tool_calls_false_keeps_the_first_call():
    text = '<tool_call>[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {}}]</tool_call>'
    content, calls = extract(get_tool_parser("xlam"), text, limit=1)
    assert [c["function"]["name"] for c in calls] == ["a"]
    stream = ToolStream(get_tool_parser("xlam"), limit=1)
    _, deltas = stream.step(text, True)
    assert {d["index"] for d in deltas} == {0}


def test_required_and_named_outputs():
    required = RequiredToolParser()
    text = '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {}}]'
    assert [c["function"] for c in extract(required, text)[1]] == [
        {"name": "a", "arguments": '{"x": 1}'},
        {"name": "b", "arguments": "{}"},
    ]
    assert _assemble(required, list(text))[1] == [
        {"name": "a", "arguments": '{"x": 1}'},
        {"name": "b", "arguments": "{}"},
    ]
    named = NamedToolParser("get_weather")
    content, calls = extract(named, '{ "city" :"Paris" }')
    assert content == "" and calls[0]["function"] == {
        "name": "get_weather",
        "arguments": '{"city": "Paris"}',
    }
    assert _assemble(named, list('{"city":"Paris"}')) == (
        None,
        [{"name": "get_weather", "arguments": '{"city": "Paris"}'}],
    )


JSON_SAMPLES = [
    '{"a": [1, -2.5e3, true, false, null, {"b": "c\\"d\\\\e\\/f\\u00e9\\ud83d\\ude00"}], "e": {}}',
    "[ 1 , 2 ,[ ] ,{ } ]",
    '"line\\nbreak\\ttab"',
    '{"raw": "a\nb"}',  # a raw newline in a string: lenient, escaped in the canonical text
]


@pytest.mark.parametrize("text", JSON_SAMPLES)
def test_canonical_prefixes_only_grow_and_end_as_json_dumps(text):
    previous = ""
    for k in range(len(text) + 1):
        now = render(scan(text[:k]).node)
        assert now.startswith(previous), (k, previous, now)
        previous = now
    assert previous == json.dumps(json.loads(text, strict=False), ensure_ascii=False)


def test_broken_json_stops_and_keeps_what_was_read():
    result = scan('{"a": 1, "b": tru, "c": 2}')
    assert result.broken and result.end is None
    assert render(result.node) == '{"a": 1, "b": '


def test_every_parser_survives_arbitrary_text():
    junk = ['<tool_call>{"name": 1}</tool_call>', "[[[[[[", '{"name": "x", "arguments": [}',
            "[TOOL_CALLS][ARGS]", "\\u", "[f(x=", "<|python_tag|>", "[" * 5000, "\x00\ud800"]  # fmt: skip
    for name in TOOL_PARSER_NAMES:
        parser = get_tool_parser(name)
        for text in junk:
            extract(parser, text)
            stream = ToolStream(parser)
            for k in range(0, len(text) + 1, max(1, len(text) // 50)):
                stream.step(text[:k], False)
            stream.step(text, True)


def test_unknown_parser_name():
    with pytest.raises(ValueError, match="unknown tool call parser 'nope'"):
        get_tool_parser("nope")

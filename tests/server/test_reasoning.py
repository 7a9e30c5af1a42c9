"""Reasoning output and the tool parsers through the whole HTTP stack, on model outputs the
embedded 135M model cannot be made to write (`<think>` sections, other models' call formats):
the server runs in process over a real LLMEngine whose scripted runner emits the tokens of a
recorded output. The openai client reads both the whole response and the stream.

Placement: the thread alone, because the scripted runner lives in this process; under tests the
thread's messages pass through the engine process's encoding (`ThreadCore`), and the engine
process itself is tested in tests/engine/test_core_process.py and the liveness suite."""

from __future__ import annotations

import argparse
import asyncio
import json

import openai
import pytest
import uvicorn

from kvflow.server.api_server import _Server, build_app
from kvflow.server.args import add_serve_arguments
from support.fake_engine import SlowRunner, make_front_end
from support.serverproc import free_port

THINK = "<think>\nThe user wants 3 + 4.\n</think>\n\nThe answer is 7."
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
USER = [{"role": "user", "content": "hi"}]


class ScriptRunner(SlowRunner):
    """Every request's output is `script`'s tokens, then end of sequence."""

    script: list[int] = []

    def _run_one(self, req_id: str, n: int) -> list[int]:
        tokens = super()._run_one(req_id, n)
        if tokens:
            st = self.states[req_id]
            index = len(st.tokens) - 1 - st.prompt_len
            token = self.script[index] if index < len(self.script) else self.eos_token_id
            st.tokens[-1] = token
            tokens = [token]
        return tokens


@pytest.fixture(scope="module")
def tokenizer():
    from kvflow.model.loader import load_tokenizer, resolve_model

    return load_tokenizer(resolve_model(None))


def run(tokenizer, argv: list[str], script: str, requests: list[dict]) -> list:
    """Serve with the flags `argv`, the model writing `script`; each request's (whole
    response, raw stream chunks)."""
    engine, _ = make_front_end(tokenizer, max_model_len=512)
    runner = ScriptRunner(block_size=16, num_blocks=64)
    runner.delay = 0.0
    runner.script = tokenizer.encode(script, add_special_tokens=False)
    engine.core.core.runner = runner
    args = add_serve_arguments(argparse.ArgumentParser()).parse_args(argv)
    app, controller = build_app(engine, args)
    config = uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning")
    server = _Server(config, controller)
    controller.server = server

    async def main() -> list:
        serving = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
        client = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{config.port}/v1", api_key="x", max_retries=0
        )
        results = []
        for body in requests:
            kwargs = {"model": "fake", "messages": USER, "max_tokens": 100, **body}
            whole = await client.chat.completions.create(**kwargs)
            stream = await client.chat.completions.create(**kwargs, stream=True)
            chunks = [chunk.model_dump() async for chunk in stream]
            results.append((whole, chunks))
        await client.close()
        controller.begin(0)
        await asyncio.wait_for(serving, 10)
        return results

    return asyncio.run(main())


def assemble(chunks: list[dict]) -> dict:
    """The stream's fields concatenated, its calls assembled by index."""
    out = {"reasoning": None, "content": None, "tool_calls": [], "finish_reason": None}
    for chunk in chunks:
        for choice in chunk["choices"]:
            delta = choice["delta"]
            for key in ("reasoning", "content"):
                if delta.get(key):
                    out[key] = (out[key] or "") + delta[key]
            for call in delta.get("tool_calls") or []:
                if call["index"] == len(out["tool_calls"]):
                    out["tool_calls"].append({"name": call["function"]["name"], "arguments": ""})
                out["tool_calls"][call["index"]]["arguments"] += call["function"]["arguments"]
            out["finish_reason"] = choice["finish_reason"] or out["finish_reason"]
    return out


def whole_fields(response) -> dict:
    choice = response.choices[0]
    message = choice.message
    return {
        "reasoning": (message.model_extra or {}).get("reasoning"),
        "content": message.content,
        "tool_calls": [
            {"name": c.function.name, "arguments": c.function.arguments}
            for c in message.tool_calls or []
        ],
        "finish_reason": choice.finish_reason,
    }


def test_qwen3_reasoning_split_streamed_or_not(tokenizer):
    requests = [{}, {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}},
                {"extra_body": {"include_reasoning": False}}]  # fmt: skip
    results = run(tokenizer, ["--reasoning-parser", "qwen3"], THINK, requests)
    expected = [
        {"reasoning": "\nThe user wants 3 + 4.\n", "content": "\n\nThe answer is 7."},
        {"reasoning": None, "content": THINK},  # thinking off: the whole output is the answer
        {"reasoning": None, "content": "\n\nThe answer is 7."},
    ]
    for (whole, chunks), want in zip(results, expected, strict=True):
        got = whole_fields(whole)
        assert {k: got[k] for k in want} == want
        assert assemble(chunks) == got
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"


def test_deepseek_r1_cut_off_reasoning_is_all_reasoning(tokenizer):
    results = run(tokenizer, ["--reasoning-parser", "deepseek_r1"], THINK, [{"max_tokens": 6}])
    whole, chunks = results[0]
    got = whole_fields(whole)
    assert got["content"] is None and got["finish_reason"] == "length"
    assert got["reasoning"] and "<think>" not in got["reasoning"]
    assert THINK.removeprefix("<think>").startswith(got["reasoning"])
    assert assemble(chunks) == got


def test_reasoning_then_a_hermes_call(tokenizer):
    argv = ["--reasoning-parser", "qwen3", "--enable-auto-tool-choice",
            "--tool-call-parser", "hermes"]  # fmt: skip
    script = "<think>I should look it up.</think>\n" + CALL
    results = run(tokenizer, argv, script, [{"tools": TOOLS}, {"tools": TOOLS,
                  "tool_choice": "none"}])  # fmt: skip
    whole, chunks = results[0]
    got = whole_fields(whole)
    assert got == {
        "reasoning": "I should look it up.",
        "content": None,
        "tool_calls": [{"name": "get_weather", "arguments": '{"city": "Paris"}'}],
        "finish_reason": "tool_calls",
    }
    assert assemble(chunks) == got
    assert whole.choices[0].message.tool_calls[0].id.startswith("chatcmpl-tool-")
    none = whole_fields(results[1][0])  # tool_choice none: no parsing, the text is the answer
    assert none["tool_calls"] == [] and none["content"] == "\n" + CALL


@pytest.mark.parametrize(
    "parser,script,calls,content",
    [
        ("mistral", 'Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
         [("get_weather", {"city": "Paris"})], "Sure."),
        ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}',
         [("get_weather", {"city": "Paris"})], None),
        ("pythonic", '[get_weather(city="Paris"), get_weather(city="Rome")]',
         [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})], None),
        ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "Pa',  # cut off
         [("get_weather", '{"city": "Pa')], None),
        ("xlam", "<tool_call>not a call</tool_call>", [], "not a call"),
    ],
)  # fmt: skip
def test_each_parser_through_the_server(tokenizer, parser, script, calls, content):
    argv = ["--enable-auto-tool-choice", "--tool-call-parser", parser]
    results = run(tokenizer, argv, script, [{"tools": TOOLS}])
    whole, chunks = results[0]
    got = whole_fields(whole)
    want = [{"name": n, "arguments": a if isinstance(a, str) else json.dumps(a)} for n, a in calls]
    assert got["tool_calls"] == want and got["content"] == content
    assert got["finish_reason"] == ("tool_calls" if calls else "stop")
    assert assemble(chunks) == got


def test_chat_template_kwargs_reach_the_template(tokenizer):
    template = "{% if enable_thinking is false %}NO-THINK{% else %}THINK{% endif %}"
    engine, _ = make_front_end(tokenizer)
    args = add_serve_arguments(argparse.ArgumentParser()).parse_args(
        ["--trust-request-chat-template"]
    )
    app, _ = build_app(engine, args)
    chat = app.state.ctx.chat
    from kvflow.server.protocol import TokenizeChatRequest

    for kwargs, text in (({"enable_thinking": False}, "NO-THINK"), ({}, "THINK")):
        req = TokenizeChatRequest(
            messages=USER, chat_template=template, chat_template_kwargs=kwargs
        )
        assert chat.render_chat(req).text == text

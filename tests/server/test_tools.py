"""Tool calling end to end: a real server on the embedded SmolLM2 with `--enable-auto-tool-choice
--tool-call-parser xlam`, the official openai client, over several seeds."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from support.serverproc import ServerProcess, start_server
from support.tool_schemas import WEATHER_PARAMETERS

MODEL = "SmolLM2-135M-Instruct"
SEEDS = range(2)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": WEATHER_PARAMETERS,
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                "b": {"type": "integer", "minimum": -1000, "maximum": 1000},
            },
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris, and what is 3 plus 4?"}]
COMMON = dict(model=MODEL, messages=ASK, tools=TOOLS, temperature=0.8, max_tokens=120)


@pytest.fixture(scope="module")
def tool_server(placement: str):
    srv = start_server("--enable-auto-tool-choice", "--tool-call-parser", "xlam")
    yield srv
    srv.stop()


@pytest.fixture
def client(tool_server: ServerProcess) -> openai.OpenAI:
    return tool_server.client(timeout=120.0)


def valid_calls(message) -> list[tuple[str, dict]]:
    """The message's calls, each checked against its tool's schema."""
    calls = []
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        calls.append((call.function.name, arguments))
    return calls


def streamed(client: openai.OpenAI, **kwargs):
    """A streamed completion, assembled as the openai client assembles one."""
    state = ChatCompletionStreamState()
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        state.handle_chunk(chunk)
    return state.get_final_completion()


def test_required_gives_valid_calls_every_time_streamed_or_not(client):
    """parallel_tool_calls false: one call (the schema's maxItems 1), so the output always ends
    (the small model, free to, goes on repeating calls until max_tokens)."""
    for seed in SEEDS:
        kwargs = dict(COMMON, tool_choice="required", parallel_tool_calls=False, seed=seed)
        choice = client.chat.completions.create(**kwargs).choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None
        calls = valid_calls(choice.message)
        assert len(calls) == 1
        again = streamed(client, **kwargs).choices[0]
        assert again.finish_reason == "tool_calls" and again.message.content is None
        assert valid_calls(again.message) == calls


def test_required_parallel_calls(client):
    out = client.chat.completions.create(**COMMON, tool_choice="required", seed=2)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert len(valid_calls(choice.message)) >= 2


def test_named_gives_that_function_every_time_streamed_or_not(client):
    for seed in SEEDS:
        name = ("get_weather", "add")[seed % 2]
        choice_field = {"type": "function", "function": {"name": name}}
        out = client.chat.completions.create(**COMMON, tool_choice=choice_field, seed=seed)
        choice = out.choices[0]
        assert choice.finish_reason == "stop"  # as OpenAI's for a named function
        assert choice.message.content is None
        calls = valid_calls(choice.message)
        assert [n for n, _ in calls] == [name]
        again = streamed(client, **COMMON, tool_choice=choice_field, seed=seed)
        assert again.choices[0].message.content is None
        assert valid_calls(again.choices[0].message) == calls


def test_auto_gives_a_call_or_text_never_a_fragment(client):
    for seed in SEEDS:
        out = client.chat.completions.create(**{**COMMON, "max_tokens": 40}, seed=seed)
        message = out.choices[0].message
        if message.tool_calls:
            valid_calls(message)
            assert out.choices[0].finish_reason == "tool_calls"
        else:
            assert message.content and out.choices[0].finish_reason in ("stop", "length")
        assert "<tool_call>" not in (message.content or "")
        again = streamed(client, **{**COMMON, "max_tokens": 40}, seed=seed).choices[0].message
        assert again.content == message.content
        assert [(c.function.name, c.function.arguments) for c in again.tool_calls or []] == [
            (c.function.name, c.function.arguments) for c in message.tool_calls or []
        ]


def test_stream_sends_openai_deltas(client):
    chunks = list(
        client.chat.completions.create(
            **COMMON, tool_choice="required", parallel_tool_calls=False, seed=0, stream=True
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    call_deltas = [d.tool_calls[0] for d in deltas if d.tool_calls]
    first = call_deltas[0]
    assert first.index == 0 and first.id and first.type == "function" and first.function.name
    for later in call_deltas[1:]:
        if later.index == 0:
            assert later.id is None and later.function.name is None
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_whole_loop_call_result_answer(client, tool_server):
    out = client.chat.completions.create(**COMMON, tool_choice="required", seed=2)
    message = out.choices[0].message
    tokenized = tool_server.post("/tokenize", {"messages": ASK, "tools": TOOLS}).json()
    assert tokenized["count"] == out.usage.prompt_tokens  # the same tool-aware template
    results = []
    for call in message.tool_calls:
        args = json.loads(call.function.arguments)
        value = f"18 degrees {args['unit']}" if call.function.name == "get_weather" else "7"
        results.append({"role": "tool", "tool_call_id": call.id, "content": value})
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [c.model_dump() for c in message.tool_calls],
        },
        *results,
    ]
    final = client.chat.completions.create(
        model=MODEL, messages=history, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=40
    )
    answer = final.choices[0]
    assert answer.message.content and not answer.message.tool_calls
    assert answer.finish_reason in ("stop", "length")
    assert final.usage.prompt_tokens > out.usage.prompt_tokens  # the results are in the prompt


def test_tool_requests_that_are_400(client, tool_server):
    bad = [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "Tool 'nope' has not been passed in `tools`."),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]},
         "Tool 'f' has an invalid parameters schema"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
         "`parameters` must be a JSON schema object"),
        ({"tool_choice": "sometimes"}, "`tool_choice` must be"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}},
         "cannot be combined with response_format"),
        ({"messages": [*ASK, {"role": "assistant", "tool_calls": [{"id": "x"}]}]},
         "Each tool call must be"),
    ]  # fmt: skip
    for extra, needle in bad:
        body = {"model": MODEL, "messages": ASK, "tools": TOOLS, "max_tokens": 4, **extra}
        resp = tool_server.post("/v1/chat/completions", body)
        assert resp.status_code == 400, (extra, resp.text)
        assert needle in resp.json()["error"]["message"], (extra, resp.text)
    assert tool_server.health() == 200


def test_an_agent_framework_runs_a_two_tool_task(tool_server):
    """The OpenAI Agents SDK's chat-completions model, unchanged, against the server, over two
    turns: the model is made to call get_weather by name, the SDK runs it and sends its result
    back as a tool message, then the model is made to call add (the 135M model does not pick a
    second tool by itself, so the tool_use_behavior hook names the next one), and the run ends
    with both results as its final output. What is checked is the round trip: named
    tool_choice, calls the SDK parses and runs, and a conversation with tool messages that the
    server takes back."""
    import asyncio
    import dataclasses

    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        Runner,
        ToolsToFinalOutputResult,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    called: list[tuple[str, object]] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        called.append(("get_weather", city))
        return f"18 degrees celsius in {city}"

    @function_tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        called.append(("add", a + b))
        return a + b

    settings = ModelSettings(tool_choice="get_weather", temperature=0.8, max_tokens=80, seed=3)
    agent = Agent(
        name="helper",
        instructions="Use the tools to answer.",
        tools=[get_weather, add],
        model_settings=settings,
        reset_tool_choice=False,
    )

    def next_tool_then_done(context, results) -> ToolsToFinalOutputResult:
        if [name for name, _ in called] == ["get_weather"]:
            agent.model_settings = dataclasses.replace(settings, tool_choice="add")
            return ToolsToFinalOutputResult(is_final_output=False)
        answer = "; ".join(str(r.output) for r in results)
        return ToolsToFinalOutputResult(is_final_output=True, final_output=answer)

    agent.tool_use_behavior = next_tool_then_done

    async def run() -> str:
        client = openai.AsyncOpenAI(
            base_url=f"{tool_server.url}/v1", api_key="EMPTY", max_retries=0, timeout=300
        )
        agent.model = OpenAIChatCompletionsModel(model=MODEL, openai_client=client)
        try:
            result = await Runner.run(agent, ASK[0]["content"], max_turns=4)
            return result.final_output
        finally:
            await client.close()

    answer = asyncio.run(run())
    assert [name for name, _ in called] == ["get_weather", "add"], called
    assert answer == str(called[1][1]), (answer, called)

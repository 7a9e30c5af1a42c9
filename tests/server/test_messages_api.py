"""Anthropic's Messages API end to end: a real server on the embedded SmolLM2 (tool calls with
`--tool-call-parser xlam`, an `--api-key` the Anthropic client sends as `x-api-key`), the
official `anthropic` client. A message is the chat completion it means: the same text as
/v1/chat/completions gives for the same turns at temperature 0, streamed or not."""

from __future__ import annotations

import anthropic
import httpx
import jsonschema
import pytest

from support.serverproc import scrape, start_server, wait_for
from support.tool_schemas import WEATHER_PARAMETERS

MODEL = "SmolLM2-135M-Instruct"
KEY = "sesame"
WEATHER = {
    "name": "get_weather",
    "description": "The current weather in a city",
    "input_schema": WEATHER_PARAMETERS,
}
ASK = [{"role": "user", "content": "Name three colours of the rainbow."}]
# the client (2.x) has no sampling arguments; the server takes Anthropic's temperature, top_p
# and top_k fields
GREEDY = {"temperature": 0}
WEATHER_ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(placement: str):
    srv = start_server("--enable-auto-tool-choice", "--tool-call-parser", "xlam", "--api-key", KEY)
    yield srv
    srv.stop()


@pytest.fixture
def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)


def test_a_message_is_the_chat_completion_it_means(client, server) -> None:
    reply = client.messages.create(
        model=MODEL, max_tokens=24, messages=ASK, system="Answer briefly.", extra_body=GREEDY
    )
    assert reply.type == "message" and reply.role == "assistant" and reply.model == MODEL
    assert [block.type for block in reply.content] == ["text"]
    assert reply.stop_reason in ("end_turn", "max_tokens")
    assert 0 < reply.usage.output_tokens <= 24
    chat = server.client(api_key=KEY).chat.completions.create(
        model=MODEL,
        max_tokens=24,
        extra_body=GREEDY,
        messages=[{"role": "system", "content": "Answer briefly."}, *ASK],
    )
    assert reply.content[0].text == chat.choices[0].message.content
    assert reply.usage.input_tokens == chat.usage.prompt_tokens
    assert reply.usage.output_tokens == chat.usage.completion_tokens
    counted = client.messages.count_tokens(model=MODEL, messages=ASK, system="Answer briefly.")
    assert counted.input_tokens == reply.usage.input_tokens


def test_stop_sequences_and_max_tokens(client) -> None:
    free = client.messages.create(model=MODEL, max_tokens=24, messages=ASK, extra_body=GREEDY)
    words = free.content[0].text.split()
    stop = next(w for w in words[1:] if w.isalpha())
    stopped = client.messages.create(
        model=MODEL, max_tokens=24, messages=ASK, stop_sequences=[stop], extra_body=GREEDY
    )
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == stop
    assert free.content[0].text.startswith(stopped.content[0].text)
    assert stop not in stopped.content[0].text
    short = client.messages.create(model=MODEL, max_tokens=2, messages=ASK, extra_body=GREEDY)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 2


def test_streamed_text_is_the_message(client) -> None:
    whole = client.messages.create(model=MODEL, max_tokens=24, messages=ASK, extra_body=GREEDY)
    kinds = []
    with client.messages.stream(
        model=MODEL, max_tokens=24, messages=ASK, extra_body=GREEDY
    ) as stream:
        for event in stream:
            kinds.append(event.type)
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_start" in kinds and "message_delta" in kinds
    assert final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens == whole.usage.input_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_use_round_trip(client, stream: bool) -> None:
    """A named tool: a tool_use block whose input meets the tool's schema (streamed: the
    client assembles it from input_json_delta events), then its result fed back in a
    tool_result block, answered with text."""
    ask = dict(
        model=MODEL,
        max_tokens=80,
        messages=WEATHER_ASK,
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
        extra_body=GREEDY,
    )
    if stream:
        with client.messages.stream(**ask) as events:
            reply = events.get_final_message()
    else:
        reply = client.messages.create(**ask)
    assert reply.stop_reason == "tool_use"
    (call,) = [block for block in reply.content if block.type == "tool_use"]
    assert call.name == "get_weather" and call.id
    jsonschema.validate(call.input, WEATHER["input_schema"])
    turns = [
        *WEATHER_ASK,
        {"role": "assistant", "content": [c.model_dump() for c in reply.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 21"}],
        },
    ]
    answer = client.messages.create(
        model=MODEL, max_tokens=30, messages=turns, tools=[WEATHER], extra_body=GREEDY
    )
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use")
    counted = client.messages.count_tokens(model=MODEL, messages=turns, tools=[WEATHER])
    assert counted.input_tokens == answer.usage.input_tokens


def test_errors_take_anthropics_shape_and_classes(client, server) -> None:
    with pytest.raises(anthropic.NotFoundError) as err:
        client.messages.create(model="no-such-model", max_tokens=5, messages=ASK)
    assert err.value.body["error"]["type"] == "not_found_error"
    for bad in (
        dict(max_tokens=0, messages=ASK),
        dict(max_tokens=5, messages=[]),
        dict(
            max_tokens=5,
            messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}],
        ),
        dict(max_tokens=5, messages=ASK, tool_choice={"type": "any"}),
    ):
        with pytest.raises(anthropic.BadRequestError) as err:
            client.messages.create(model=MODEL, **bad)
        assert err.value.body["type"] == "error"
        assert err.value.body["error"]["type"] == "invalid_request_error"
    missing = httpx.post(
        f"{server.url}/v1/messages",
        json={"model": MODEL, "messages": ASK},
        headers={"x-api-key": KEY},
    )
    assert missing.status_code == 400 and missing.json()["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in missing.json()["error"]["message"]
    wrong = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as err:
        wrong.messages.create(model=MODEL, max_tokens=5, messages=ASK)
    assert err.value.body["error"]["type"] == "authentication_error"
    # the OpenAI routes keep vLLM's shape, and the server is up
    chat = httpx.post(f"{server.url}/v1/chat/completions", json={}, headers={"x-api-key": KEY})
    assert chat.status_code == 400 and chat.json()["error"]["type"] == "BadRequestError"
    assert httpx.get(f"{server.url}/health").status_code == 200


LABELS = {"model_name": MODEL, "engine": "0"}


def _idle(server) -> bool:
    m = scrape(server)
    busy = m.value("vllm:num_requests_running", **LABELS) + m.value(
        "vllm:num_requests_waiting", **LABELS
    )
    return busy == 0 and m.value("vllm:kv_cache_usage_perc", **LABELS) == 0


def test_a_client_leaving_a_stream_frees_its_request(server) -> None:
    """A streamed message whose client goes away mid-stream is aborted: its KV blocks free
    within a second, counted as an abort, as a chat stream's are."""
    wait_for(lambda: _idle(server), timeout=10)
    aborts = scrape(server).value("vllm:request_success_total", finished_reason="abort")
    story = [{"role": "user", "content": "Write a long story about a dragon and a knight."}]
    body = {"model": MODEL, "max_tokens": 800, "messages": story, "stream": True}
    with httpx.stream(
        "POST", f"{server.url}/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=60
    ) as resp:
        events = (line for line in resp.iter_lines() if line.startswith("event: "))
        assert next(events) == "event: message_start"
        assert next(events) == "event: content_block_start"
        assert next(events) == "event: content_block_delta"
    wait_for(lambda: _idle(server), timeout=1.0)
    after = scrape(server).value("vllm:request_success_total", finished_reason="abort")
    assert after == aborts + 1

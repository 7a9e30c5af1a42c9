"""POST /v1/chat/completions end to end, plus the small routes (models, tokenize, health)."""

from __future__ import annotations

import json

import httpx

MODEL = "SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


def test_chat_greedy_answer_and_usage(server, client):
    out = client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_completion_tokens=16
    )
    choice = out.choices[0]
    assert "Paris" in choice.message.content
    assert choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    prompt = server.post("/tokenize", {"messages": QUESTION}).json()["count"]
    assert out.usage.prompt_tokens == prompt
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    assert 0 < out.usage.completion_tokens <= 16
    assert out.usage.total_tokens == prompt + out.usage.completion_tokens


def test_max_tokens_and_max_completion_tokens_are_both_honoured(client):
    for field in ("max_tokens", "max_completion_tokens"):
        out = client.chat.completions.create(
            model=MODEL,
            messages=QUESTION,
            temperature=0,
            extra_body={field: 3, "ignore_eos": True},
        )
        assert out.usage.completion_tokens == 3
        assert out.choices[0].finish_reason == "length"


def test_chat_streaming_role_first_then_content_usage_done(server, client):
    expected = client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=8
    )
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=QUESTION,
            temperature=0,
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage == expected.usage
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == expected.choices[0].finish_reason


def test_echo_starts_the_reply_with_a_continued_message(client):
    """vLLM's chat `echo`: continuing the last (assistant) message, the reply starts with it,
    streamed or not; with a generation prompt after a user message there is nothing to echo."""
    partial = [*QUESTION, {"role": "assistant", "content": "The capital"}]
    continued = {"add_generation_prompt": False, "continue_final_message": True}
    common = dict(model=MODEL, messages=partial, temperature=0, max_tokens=4)
    plain = client.chat.completions.create(**common, extra_body=continued)
    echoed = client.chat.completions.create(**common, extra_body={**continued, "echo": True})
    reply = plain.choices[0].message.content
    assert echoed.choices[0].message.content == "The capital" + reply
    assert echoed.usage == plain.usage
    stream = client.chat.completions.create(
        **common, stream=True, extra_body={**continued, "echo": True}
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == "The capital" + reply
    asked = client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=4, extra_body={"echo": True}
    )
    unechoed = client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=4
    )
    assert asked.choices[0].message.content == unechoed.choices[0].message.content


def test_chat_raw_sse_records_chunks(server):
    body = {"messages": QUESTION, "max_tokens": 3, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60) as resp:
        lines = [line for line in resp.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    server.received.extend(("stream", "/v1/chat/completions", 200, c) for c in chunks)


def test_chat_n_choices(client):
    out = client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        n=2,
        temperature=1.0,
        seed=3,
        max_tokens=4,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in out.choices] == [0, 1]
    assert out.usage.completion_tokens == 8


def test_chat_logprobs_format(client):
    out = client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=4, logprobs=True, top_logprobs=2
    )
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    assert "".join(t.token for t in content) == out.choices[0].message.content
    for entry in content:
        assert entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].token == entry.token  # greedy
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
    plain = client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=2
    )
    assert plain.choices[0].logprobs is None


def test_models_lists_the_servable_context(server):
    data = server.get("/v1/models").json()
    card = data["data"][0]
    assert data["object"] == "list"
    assert card["id"] == MODEL and card["object"] == "model" and card["owned_by"] == "kvflow"
    assert card["max_model_len"] == 1024 and card["root"]


def test_tokenize_detokenize_round_trip(server):
    text = "Hello world, this is kvflow."
    tok = server.post("/tokenize", {"prompt": text}).json()
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 1024
    back = server.post("/detokenize", {"tokens": tok["tokens"]}).json()
    assert back["prompt"] == text
    strs = server.post("/tokenize", {"prompt": text, "return_token_strs": True}).json()
    assert len(strs["token_strs"]) == tok["count"]


def test_health_ping_version(server):
    health = httpx.get(f"{server.url}/health", timeout=10)
    assert health.status_code == 200 and health.content == b""
    assert httpx.get(f"{server.url}/ping", timeout=10).status_code == 200
    assert httpx.post(f"{server.url}/ping", timeout=10).status_code == 200
    assert server.get("/version").json()["version"]

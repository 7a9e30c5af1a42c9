"""Every refusal: vLLM's error shape, HTTP status == code, the type, and a message with the
numbers. Refused requests never reach the engine, and the server stays healthy."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from support.serverproc import scrape

CAPITAL = "The capital of France is"


def error_of(resp: httpx.Response, status: int, err_type: str) -> str:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status and err["type"] == err_type
    return err["message"]


def post_raw(
    server, path: str, content: str | bytes, content_type: str = "application/json"
) -> httpx.Response:
    """A body sent as is (not JSON the client made): NaN literals, escapes, broken JSON."""
    headers = {"content-type": content_type}
    return httpx.post(f"{server.url}{path}", content=content, headers=headers, timeout=10)


def test_over_long_prompt_is_400_before_anything_is_queued(server):
    before = scrape(server)
    resp = server.post("/v1/completions", {"prompt": [504] * 1100, "max_tokens": 4})
    msg = error_of(resp, 400, "BadRequestError")
    assert msg == (
        "This model's maximum context length is 1024 tokens. However, your request has 1100 "
        "input tokens. Please reduce the length of the input messages."
    )
    chat = server.post(
        "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi " * 1200}]}
    )
    assert "maximum context length is 1024 tokens" in error_of(chat, 400, "BadRequestError")
    after = scrape(server)
    for name in ("vllm:request_success_total", "vllm:prompt_tokens_total"):
        assert after.value(name) == before.value(name)
    assert after.value("vllm:num_requests_waiting") == 0


def test_megabytes_of_prompt_are_refused_before_the_tokenizer_runs(server):
    """More characters than max_model_len tokens can hold (1024 x the longest token, 81 for
    SmolLM2) is a 400 at once: tokenizing 5 MB held the event loop for 2.8 s."""
    huge = "a" * 5_000_000
    for path, body in (
        ("/v1/completions", {"prompt": huge}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": huge}]}),
        ("/tokenize", {"prompt": huge}),
    ):
        message = error_of(server.post(path, body), 400, "BadRequestError")
        # the characters' bound, not a token count: the tokenizer never ran
        assert "upper bound for 1024 input tokens" in message and "82944 characters" in message
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


def test_too_large_max_tokens_names_the_numbers(server):
    resp = server.post("/v1/completions", {"prompt": CAPITAL, "max_tokens": 2000})
    assert error_of(resp, 400, "BadRequestError") == (
        "'max_tokens' or 'max_completion_tokens' is too large: 2000. This model's maximum "
        "context length is 1024 tokens and your request has 5 input tokens (2000 > 1024 - 5)."
    )
    chat = server.post(
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 5000},
    )
    assert "is too large: 5000" in error_of(chat, 400, "BadRequestError")


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("temperature", -1, "temperature must be non-negative, got -1.0"),
        ("top_p", 0, "top_p must be in (0, 1], got 0"),
        ("top_k", -5, "top_k must be 0 or -1 (disable), or at least 1, got -5"),
        ("n", 0, "n must be at least 1, got 0"),
        ("logprobs", 50, "logprobs must be in [0, 20], got 50"),
        ("best_of", 3, "best_of must be 1 or equal to n, got best_of=3"),
        ("repetition_penalty", 0, "repetition_penalty must be greater than zero, got 0"),
        ("temperature", 2.5, "temperature must be in [0, 2], got 2.5"),
        ("n", 10**22, "n must be at most 16384, got 10000000000000000000000"),
        ("min_p", 1.5, "min_p must be in [0, 1], got 1.5"),
        ("max_tokens", 0, "max_tokens must be at least 1, got 0"),
    ],
)
def test_invalid_sampling_values_are_400(server, field, value, needle):
    resp = server.post("/v1/completions", {"prompt": CAPITAL, field: value})
    assert needle in error_of(resp, 400, "BadRequestError")


def test_non_finite_sampling_values_are_400(server):
    """JSON's NaN and Infinity (which Python's parser takes) are refused, not sampled with."""
    for literal in ("NaN", "Infinity", "1e400"):
        body = f'{{"prompt": "{CAPITAL}", "max_tokens": 2, "temperature": {literal}}}'
        raw = post_raw(server, "/v1/completions", body)
        assert "temperature must be a finite number" in error_of(raw, 400, "BadRequestError")


def test_text_that_is_not_unicode_is_400_not_500(server):
    """A lone surrogate (JSON's \\ud800) in a prompt, a message or /tokenize's prompt."""
    bodies = [
        ("/v1/completions", '{"prompt": "Hi \\ud800 there", "max_tokens": 2}', "prompt"),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "a\\ud800"}]}',
         "messages"),
        ("/tokenize", '{"prompt": "\\udfff"}', "prompt"),
    ]  # fmt: skip
    for path, body, param in bodies:
        raw = post_raw(server, path, body)
        message = error_of(raw, 400, "BadRequestError")
        assert message == f"The text in `{param}` is not valid Unicode (surrogates not allowed)."
        assert raw.json()["error"]["param"] == param


def test_chat_templates_tools_and_formats_as_vllm_refuses_them(server):
    """(Output constraints themselves: test_structured.py.)"""
    user = [{"role": "user", "content": "hi"}]
    tool = {"type": "function", "function": {"name": "get_time", "parameters": {}}}
    refused = [
        ({"chat_template": "{{ 'x' }}"}, "--trust-request-chat-template is not set"),
        ({"chat_template_kwargs": {"chat_template": "x"}}, "untrusted chat template"),
        ({"chat_template_kwargs": {"tokenize": True}}, "unexpected chat template kwargs"),
        # as vLLM without --enable-auto-tool-choice: tools alone mean "auto", which needs it
        ({"tools": [tool]}, '"auto" tool choice requires --enable-auto-tool-choice'),
        ({"tool_choice": "auto"}, "When using `tool_choice`, `tools` must be set."),
        ({"tools": []}, "`tools` must not be an empty array"),
        ({"tools": [{"foo": 1}], "tool_choice": "none"}, "Each tool must be"),
        ({"response_format": {"type": "xml"}}, "'xml' is not one of"),
    ]
    for extra, needle in refused:
        resp = server.post("/v1/chat/completions", {"messages": user, "max_tokens": 2, **extra})
        assert needle in error_of(resp, 400, "BadRequestError"), extra
    fmt = {"prompt": CAPITAL, "response_format": {"type": "xml"}}
    assert "'xml' is not one of" in error_of(
        server.post("/v1/completions", fmt), 400, "BadRequestError"
    )
    served = [
        {"tools": [tool], "tool_choice": "none"},  # rendered into the prompt only
        {"tools": [tool], "tool_choice": "required"},  # the grammar makes the call
        {"chat_template_kwargs": {"add_generation_prompt": False}},  # the request's field wins
    ]
    for extra in served:
        resp = server.post("/v1/chat/completions", {"messages": user, "max_tokens": 2, **extra})
        assert resp.status_code == 200, (extra, resp.text)


def test_vllm_caps_and_fields_kvflow_lacks_are_400_not_ignored(server):
    cases = [
        ({"prompt": ["a"] * 1025}, "prompt list length 1025 exceeds the maximum allowed count"),
        ({"prompt": ["a"] * 1024, "n": 17}, "1024 prompts x n=17 = 17408 choices; at most 16384"),
        ({"prompt": CAPITAL, "stop": list("abcde")}, "stop"),
        ({"prompt": CAPITAL, "allowed_token_ids": [5]}, "`allowed_token_ids` is not supported"),
        ({"prompt": CAPITAL, "bad_words": ["x"]}, "`bad_words` is not supported"),
        ({"prompt": CAPITAL, "truncate_prompt_tokens": 5000}, "smaller truncation size"),
    ]
    for body, needle in cases:
        message = error_of(server.post("/v1/completions", body), 400, "BadRequestError")
        assert needle in message, (body.keys(), message)


def test_truncate_prompt_tokens_keeps_the_last_tokens_or_the_first(server):
    ids = list(range(1000, 1020))
    for side, kept in ((None, ids[-6:]), ("left", ids[-6:]), ("right", ids[:6])):
        body = {"prompt": ids, "max_tokens": 1, "temperature": 0, "echo": True}
        extra = {"truncate_prompt_tokens": 6} | ({} if side is None else {"truncation_side": side})
        out = server.post("/v1/completions", {**body, **extra}).json()
        assert out["usage"]["prompt_tokens"] == 6, out
        text = server.post("/detokenize", {"tokens": kept}).json()["prompt"]
        assert out["choices"][0]["text"].startswith(text)
    chat = {"messages": [{"role": "user", "content": "hello " * 50}], "max_tokens": 1}
    out = server.post("/v1/chat/completions", {**chat, "truncate_prompt_tokens": 10}).json()
    assert out["usage"]["prompt_tokens"] == 10


def test_unknown_model_is_404(server, client):
    resp = server.post("/v1/completions", {"model": "gpt-9", "prompt": CAPITAL})
    assert error_of(resp, 404, "NotFoundError") == "The model `gpt-9` does not exist."
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "x"}])
    assert info.value.status_code == 404


def test_schema_errors_are_400_not_422(server):
    missing = server.post("/v1/completions", {"max_tokens": 3})
    assert "prompt" in error_of(missing, 400, "BadRequestError")
    wrong = server.post("/v1/completions", {"prompt": CAPITAL, "max_tokens": "many"})
    assert "max_tokens" in error_of(wrong, 400, "BadRequestError")
    raw = post_raw(server, "/v1/completions", b"{not json")
    assert "Invalid JSON" in error_of(raw, 400, "BadRequestError")


def test_a_body_that_is_not_json_is_named_as_such(server):
    body = json.dumps({"prompt": CAPITAL, "max_tokens": 1})
    # text/plain, and what `curl -d` sends without a Content-Type header of its own
    for content_type in ("text/plain", "application/x-www-form-urlencoded"):
        resp = post_raw(server, "/v1/completions", body, content_type)
        assert error_of(resp, 400, "BadRequestError") == (
            f"Content-Type must be application/json, got {content_type}."
        )
    for content_type in ("application/json; charset=utf-8", "application/vnd.api+json"):
        assert post_raw(server, "/v1/completions", body, content_type).status_code == 200


def test_unsupported_and_malformed_inputs_are_400(server):
    cases = [
        ({"prompt": CAPITAL, "suffix": "x"}, "suffix is not currently supported"),
        ({"prompt": ""}, "The prompt cannot be empty."),
        ({"prompt": [10**9]}, "prompt token ids must be in [0, 49152)"),
        ({"prompt": CAPITAL, "stream_options": {"include_usage": True}}, "stream=True"),
    ]
    for body, needle in cases:
        assert needle in error_of(server.post("/v1/completions", body), 400, "BadRequestError")
    chat = server.post(
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
    )
    assert "`logprobs` must be set to true" in error_of(chat, 400, "BadRequestError")


def test_official_client_raises_bad_request(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="SmolLM2-135M-Instruct", prompt=CAPITAL, max_tokens=9999)
    assert info.value.status_code == 400
    assert "9999 > 1024 - 5" in info.value.body["message"]


def test_unknown_route_and_health_after_bad_input(server):
    error_of(server.get("/v1/nothing"), 404, "NotFoundError")
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200

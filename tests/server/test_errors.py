"""Every refusal: vLLM's error shape, HTTP status == code, the type, and a message with the
numbers. Refused requests never reach the engine, and the server stays healthy."""

from __future__ import annotations

import httpx
import openai
import pytest
from serverproc import scrape

CAPITAL = "The capital of France is"


def error_of(resp: httpx.Response, status: int, err_type: str) -> str:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status and err["type"] == err_type
    return err["message"]


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
        ("repetition_penalty", 0, "repetition_penalty must be in (0, 2], got 0"),
        ("min_p", 1.5, "min_p must be in [0, 1], got 1.5"),
        ("max_tokens", 0, "max_tokens must be at least 1, got 0"),
    ],
)
def test_invalid_sampling_values_are_400(server, field, value, needle):
    resp = server.post("/v1/completions", {"prompt": CAPITAL, field: value})
    assert needle in error_of(resp, 400, "BadRequestError")


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
    raw = httpx.post(
        f"{server.url}/v1/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
        timeout=10,
    )
    assert "Invalid JSON" in error_of(raw, 400, "BadRequestError")


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

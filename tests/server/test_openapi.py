"""/openapi.json is true: every JSON body the tests received validates against the schema the
document gives for that route and status, and SSE chunks against the chunk schemas."""

from __future__ import annotations

import httpx
import jsonschema
import pytest

MESSAGES = [{"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def spec(server) -> dict:
    return httpx.get(f"{server.url}/openapi.json", timeout=30).json()


def schema_for(spec: dict, method: str, path: str, status: int) -> dict:
    if method == "stream":
        responses = spec["paths"][path]["post"]["responses"]
        return responses["200"]["content"]["text/event-stream"]["schema"]
    responses = spec["paths"][path][method]["responses"]
    assert str(status) in responses, f"{method.upper()} {path} -> {status} is not documented"
    return responses[str(status)]["content"]["application/json"]["schema"]


def validate(spec: dict, method: str, path: str, status: int, body: object) -> None:
    schema = {**schema_for(spec, method, path, status), "components": spec["components"]}
    jsonschema.validate(body, schema, cls=jsonschema.Draft202012Validator)


def exercise(server) -> None:
    """A representative answer from every JSON route, successes and errors."""
    server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "logprobs": 1})
    server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "echo": True, "n": 2})
    server.post("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2})
    server.post(
        "/v1/chat/completions",
        {"messages": MESSAGES, "max_tokens": 2, "logprobs": True, "top_logprobs": 2},
    )
    server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 5000})
    server.post("/v1/completions", {"model": "nope", "prompt": "Hi"})
    server.post("/v1/chat/completions", {"messages": "not a list"})
    server.post("/tokenize", {"prompt": "Hi"})
    server.post("/tokenize", {"messages": MESSAGES})
    server.post("/detokenize", {"tokens": [1, 2, 3]})
    server.post("/detokenize", {"tokens": [-1]})
    server.get("/v1/models")
    server.get("/version")


def test_documented_routes_and_no_422(spec):
    paths = spec["paths"]
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/ping"):
        assert path in paths
    for path in ("/metrics", "/tokenize", "/detokenize", "/version"):
        assert path in paths
    for path, ops in paths.items():
        for method, op in ops.items():
            assert "422" not in op["responses"], f"{method} {path} still documents 422"


def test_every_received_body_validates(server, spec):
    exercise(server)
    seen = {(m, p, s) for m, p, s, _ in server.received}
    assert ("post", "/v1/completions", 200) in seen and ("post", "/v1/completions", 404) in seen
    assert ("post", "/v1/chat/completions", 400) in seen
    for method, path, status, body in server.received:
        if path in spec["paths"]:  # not the deliberate requests to unknown routes
            validate(spec, method, path, status, body)


def test_a_wrong_body_would_fail(spec):
    with pytest.raises(jsonschema.ValidationError):
        validate(spec, "get", "/v1/models", 200, {"object": "list", "data": [{"id": 3}]})

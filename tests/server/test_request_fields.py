"""Request fields kvflow does not know: ignored with a warning that names each one once per
server (vLLM's words), or with --strict-request-fields refused with a 400 that names them."""

from __future__ import annotations

import uuid

import pytest

from support.serverproc import ServerProcess, start_server

WARNING = "The following fields were present in the request but ignored: "
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}


def test_an_unknown_field_is_logged_once_per_name(server):
    first, second = (f"kvflow_test_{uuid.uuid4().hex[:8]}" for _ in range(2))
    for _ in range(3):
        resp = server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 1, first: 1})
        assert resp.status_code == 200, resp.text
    resp = server.post("/v1/chat/completions", {**CHAT, first: True, second: "x"})
    assert resp.status_code == 200, resp.text
    assert server.post("/tokenize", {"prompt": "Hi", second: 0}).status_code == 200
    # the fields the server knows, vLLM's refused ones among them, are never reported
    known = {"prompt": "Hi", "max_tokens": 1, "bad_words": None, "guided_json": None}
    assert server.post("/v1/completions", known).status_code == 200
    warnings = [line for line in server.log().splitlines() if WARNING in line]
    assert sum(first in line for line in warnings) == 1, warnings
    assert sum(second in line for line in warnings) == 1, warnings
    assert not any(f"'{name}'" in line for line in warnings for name in known), warnings


@pytest.fixture(scope="module")
def strict(placement: str):
    srv = start_server("--strict-request-fields")
    yield srv
    srv.stop()


def test_strict_mode_refuses_unknown_fields_by_name(strict: ServerProcess):
    resp = strict.post("/v1/chat/completions", {**CHAT, "temprature": 0.5, "max_token": 3})
    assert resp.status_code == 400, resp.text
    assert resp.json() == {
        "error": {
            "message": "Unknown request fields: `max_token`, `temprature` (refused under "
            "--strict-request-fields).",
            "type": "BadRequestError",
            "param": "max_token",
            "code": 400,
        }
    }
    tokenize = strict.post("/tokenize", {"prompt": "Hi", "add_bos": True})
    assert tokenize.status_code == 400 and "`add_bos`" in tokenize.json()["error"]["message"]
    # known fields pass, and nothing was logged as ignored
    assert strict.post("/v1/chat/completions", {**CHAT, "temperature": 0}).status_code == 200
    assert WARNING not in strict.log()

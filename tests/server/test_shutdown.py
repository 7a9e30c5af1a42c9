"""Signals against the real process: every in-flight client gets a terminal answer, then the
process exits 0 within a bound; --shutdown-timeout drains; a second signal exits at once.
Also --api-key, on the same throwaway server."""

from __future__ import annotations

import json
import signal
import time

import httpx

from support.serverproc import ServerProcess, in_background, scrape, start_server, wait_for

LONG = {"prompt": "Once upon a time", "max_tokens": 900, "ignore_eos": True, "temperature": 0}


def running(server: ServerProcess) -> float:
    return scrape(server).value("vllm:num_requests_running")


def stream_lines(server: ServerProcess, body: dict, headers: dict) -> list[str]:
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json=body, headers=headers, timeout=60
    ) as resp:
        assert resp.status_code == 200
        return [line for line in resp.iter_lines() if line]


def check_api_key(server: ServerProcess, auth: dict) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        resp = httpx.get(f"{server.url}/v1/models", headers=headers, timeout=10)
        assert resp.status_code == 401
        assert resp.json()["error"]["code"] == 401
        assert resp.json()["error"]["type"] == "AuthenticationError"
    bad = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x"}, timeout=10)
    assert bad.status_code == 401
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    assert httpx.get(f"{server.url}/metrics", timeout=10).status_code == 200
    out = server.client(api_key="sekret").completions.create(
        model="SmolLM2-135M-Instruct", prompt="Hi", max_tokens=2
    )
    assert out.usage.completion_tokens == 2
    assert httpx.get(f"{server.url}/v1/models", headers=auth, timeout=10).status_code == 200


def test_api_key_then_sigterm_aborts_in_flight_and_exits_0():
    server = start_server("--api-key", "sekret")
    auth = {"Authorization": "Bearer sekret"}
    try:
        check_api_key(server, auth)
        streamer, streamed = in_background(
            lambda: stream_lines(server, {**LONG, "stream": True}, auth)
        )
        poster, posted = in_background(
            lambda: httpx.post(f"{server.url}/v1/completions", json=LONG, headers=auth, timeout=60)
        )
        wait_for(lambda: running(server) == 2, timeout=30)
        sent = server.signal(signal.SIGTERM)
        code = server.wait_exit(timeout=15)
        exited = time.monotonic() - sent
        streamer.join(10)
        poster.join(10)
    finally:
        server.kill()
    assert code == 0 and exited < 3.0, f"exit {code} after {exited:.2f}s"
    lines = streamed["value"]
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2][len("data: ") :])["error"]
    assert error["code"] == 503 and "shutting down" in error["message"]
    resp = posted["value"]
    assert resp.status_code == 503
    assert resp.json()["error"]["type"] == "ServiceUnavailableError"
    assert "Traceback" not in server.log()


def test_shutdown_timeout_drains_refuses_new_then_exits_0():
    server = start_server("--shutdown-timeout", "30")
    body = {**LONG, "max_tokens": 24}
    try:
        poster, posted = in_background(
            lambda: httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        )
        wait_for(lambda: running(server) == 1, timeout=30)
        sent = server.signal(signal.SIGTERM)
        wait_for(lambda: httpx.get(f"{server.url}/health", timeout=5).status_code == 503, 5)
        t0 = time.monotonic()
        refused = httpx.post(f"{server.url}/v1/completions", json=body, timeout=10)
        refused_in = time.monotonic() - t0
        poster.join(60)
        answered = time.monotonic()
        code = server.wait_exit(timeout=15)
        exit_after_answer = time.monotonic() - answered
    finally:
        server.kill()
    assert refused.status_code == 503 and refused_in < 1.0
    assert "shutting down" in refused.json()["error"]["message"]
    finished = posted["value"].json()
    assert finished["choices"][0]["finish_reason"] == "length"
    assert finished["usage"]["completion_tokens"] == 24
    assert code == 0 and exit_after_answer < 3.0
    assert time.monotonic() - sent < 60


def test_second_signal_exits_at_once():
    server = start_server("--shutdown-timeout", "30")
    try:
        poster, _ = in_background(
            lambda: httpx.post(f"{server.url}/v1/completions", json=LONG, timeout=60)
        )
        wait_for(lambda: running(server) == 1, timeout=30)
        server.signal(signal.SIGTERM)
        wait_for(lambda: httpx.get(f"{server.url}/health", timeout=5).status_code == 503, 5)
        assert server.proc.poll() is None, "a draining server must wait for its request"
        sent = server.signal(signal.SIGTERM)
        code = server.wait_exit(timeout=10)
        exited = time.monotonic() - sent
        poster.join(10)
    finally:
        server.kill()
    assert code == 128 + signal.SIGTERM and exited < 1.0

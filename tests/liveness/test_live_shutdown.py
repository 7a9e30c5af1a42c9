"""Property 7 (P9/P10) against real processes and real signals.

SIGTERM with the default --shutdown-timeout 0 while streaming and non-streaming requests run
(official client and raw HTTP, completions and chat): every client gets a terminal answer and
the process exits 0 within 2 s, in every one of KVFLOW_SHUTDOWN_TRIALS (8) trials. The next
trial's server loads while the current one runs, to keep the suite short on 2 cores.
With --shutdown-timeout 30: 503 at once for new requests, in-flight ones finish, then exit 0.
A second signal exits at once. No child process survives, and the pid is gone.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import openai
import pytest

from support.live import (
    LONG_WAIT,
    MODEL,
    PROMPT,
    ServerProcess,
    geometry,
    in_background,
    serving,
    spawn,
    sse_events,
    start,
    wait_for,
)

TRIALS = int(os.environ.get("KVFLOW_SHUTDOWN_TRIALS", "8"))
EXIT_BOUND_S = 2.0
FLAGS = geometry(16, 64)
LONG = {"model": MODEL, "prompt": PROMPT, "max_tokens": 500, "ignore_eos": True}
HI = [{"role": "user", "content": "Hi"}]
CHAT = {"model": MODEL, "messages": HI, "max_tokens": 500, "ignore_eos": True}
Client = Callable[[ServerProcess, threading.Event], str]
API_LONG = {"prompt": "Once upon a time", "max_tokens": 900, "ignore_eos": True, "temperature": 0}


def openai_stream(server: ServerProcess, started: threading.Event) -> str:
    chunks = server.client().completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=500, stream=True, extra_body={"ignore_eos": True}
    )
    try:
        for chunk in chunks:
            started.set()
            if chunk.choices and chunk.choices[0].finish_reason:
                return f"finish_reason {chunk.choices[0].finish_reason}"
    except openai.APIConnectionError:
        raise
    except openai.APIError as err:
        return f"error event: {err.message}"
    return "SILENT: the stream closed without a terminal answer"


def openai_plain(server: ServerProcess, started: threading.Event) -> str:
    started.set()
    try:
        out = server.client().completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=500, extra_body={"ignore_eos": True}
        )
    except openai.APIStatusError as err:
        return f"{err.status_code}: {err.message}"
    return f"finish_reason {out.choices[0].finish_reason}"


def raw_stream(path: str, body: dict) -> Client:
    def client(server: ServerProcess, started: threading.Event) -> str:
        lines = []
        url, streamed = f"{server.url}{path}", {**body, "stream": True}
        with httpx.stream("POST", url, json=streamed, timeout=LONG_WAIT) as resp:
            for line in resp.iter_lines():
                if line:
                    lines.append(line)
                    started.set()
        last = sse_events(lines)[-1]  # asserts the closing [DONE]
        if "error" in last:
            return f"error event {last['error']['code']}"
        return f"finish_reason {last['choices'][0]['finish_reason']}"

    return client


def raw_plain(path: str, body: dict) -> Client:
    def client(server: ServerProcess, started: threading.Event) -> str:
        started.set()
        resp = httpx.post(f"{server.url}{path}", json=body, timeout=60)
        return f"{resp.status_code}: {resp.json()}"  # a body, whatever the status

    return client


CLIENTS: dict[str, Client] = {
    "openai stream": openai_stream,
    "openai plain": openai_plain,
    "raw stream": raw_stream("/v1/completions", LONG),
    "raw chat stream": raw_stream("/v1/chat/completions", CHAT),
    "raw chat plain": raw_plain("/v1/chat/completions", CHAT),
}


def terminal(answer: str) -> bool:
    return (
        answer.startswith(("finish_reason abort", "error event", "503")) and "SILENT" not in answer
    )


def alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


def run_trial(server: ServerProcess) -> tuple[int, float, dict[str, str]]:
    """Traffic, then SIGTERM; returns (exit status, seconds to exit, answer per client)."""
    started = {name: threading.Event() for name in CLIENTS}
    running = {
        name: in_background(lambda c=client, e=started[name]: c(server, e))
        for name, client in CLIENTS.items()
    }
    wait_for(lambda: all(e.is_set() for e in started.values()), timeout=60)
    wait_for(lambda: server.gauge("vllm:num_requests_running") == len(CLIENTS), timeout=60)
    children = server.children()
    sent = server.signal(signal.SIGTERM)
    code = server.wait_exit(timeout=30)
    exited = time.monotonic() - sent
    answers = {}
    for name, (thread, result) in running.items():
        thread.join(10)
        answers[name] = str(result.get("value", f"CLIENT ERROR {result.get('error')!r}"))
    assert not alive(server.pid) and not [c for c in children if alive(c)]
    return code, exited, answers


@pytest.mark.slow
def test_sigterm_during_traffic_answers_every_client_and_exits_0_in_every_trial() -> None:
    exits: list[float] = []
    upcoming = spawn(FLAGS)
    try:
        for trial in range(TRIALS):
            server = start_spawned(upcoming)
            upcoming = spawn(FLAGS) if trial + 1 < TRIALS else None
            try:
                code, exited, answers = run_trial(server)
            finally:
                server.kill()
            bad = {k: v for k, v in answers.items() if not terminal(v)}
            assert code == 0 and exited < EXIT_BOUND_S and not bad, (trial, code, exited, bad)
            assert "Traceback" not in server.log(), server.log()[-3000:]
            exits.append(exited)
    finally:
        if upcoming is not None:
            upcoming.kill()
    print(f"  {len(exits)}/{TRIALS} trials: exit 0 in {min(exits):.2f}-{max(exits):.2f} s")
    print(f"  (mean {sum(exits) / len(exits):.2f} s); {len(CLIENTS)} clients each, all answered")
    print(f"  last answers: {answers}")


def start_spawned(server: ServerProcess) -> ServerProcess:
    deadline = time.monotonic() + 240
    while server.health() != 200:
        assert server.proc.poll() is None, server.log()[-3000:]
        assert time.monotonic() < deadline, server.log()[-3000:]
        time.sleep(0.1)
    return server


def test_drain_refuses_new_at_once_finishes_in_flight_then_exits_0() -> None:
    server = start([*FLAGS, "--shutdown-timeout", "30"])
    body = {**LONG, "max_tokens": 24}
    try:
        plain_thread, plain = in_background(lambda: server.post("/v1/completions", body))
        stream_thread, stream = in_background(
            lambda: raw_stream("/v1/completions", body)(server, threading.Event())
        )
        wait_for(lambda: server.gauge("vllm:num_requests_running") == 2, timeout=30)
        children = server.children()
        sent = server.signal(signal.SIGTERM)
        wait_for(lambda: server.health() == 503, timeout=5)
        t0 = time.monotonic()
        refused = server.post("/v1/completions", body, timeout=10)
        refused_in = time.monotonic() - t0
        plain_thread.join(60)
        stream_thread.join(60)
        answered = time.monotonic()
        code = server.wait_exit(timeout=30)
        after_answer = time.monotonic() - answered
    finally:
        server.kill()
    print(f"  drain: new request 503 in {refused_in * 1000:.0f} ms; in-flight finished;")
    print(
        f"  exit {code} {after_answer:.2f} s after the last answer ({answered - sent:.1f} s drain)"
    )
    assert refused.status_code == 503 and refused_in < 1.0
    assert "shutting down" in refused.json()["error"]["message"]
    assert plain["value"].json()["choices"][0]["finish_reason"] == "length"
    assert plain["value"].json()["usage"]["completion_tokens"] == 24
    assert stream["value"] == "finish_reason length"
    assert code == 0 and after_answer < EXIT_BOUND_S
    assert answered - sent < 60
    assert not alive(server.pid) and not [c for c in children if alive(c)]


def test_second_signal_exits_at_once() -> None:
    with serving([*FLAGS, "--shutdown-timeout", "30"]) as server:
        thread, _ = in_background(lambda: server.post("/v1/completions", LONG))
        wait_for(lambda: server.gauge("vllm:num_requests_running") == 1, timeout=30)
        server.signal(signal.SIGTERM)
        wait_for(lambda: server.health() == 503, timeout=5)
        assert server.proc.poll() is None, "a draining server waits for its request"
        sent = server.signal(signal.SIGTERM)
        code = server.wait_exit(timeout=10)
        exited = time.monotonic() - sent
        thread.join(10)
    print(f"  second signal: exit {code} in {exited * 1000:.0f} ms")
    assert code == 128 + signal.SIGTERM and exited < 1.0
    assert not alive(server.pid)


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


def test_api_key_then_sigterm_aborts_in_flight_and_exits_0() -> None:
    """--api-key guards the API (not /health, /metrics); SIGTERM then answers the authorised
    clients in flight with 503s (a stream's error event, then [DONE])."""
    server = start([*FLAGS, "--api-key", "sekret"])
    auth = {"Authorization": "Bearer sekret"}
    try:
        check_api_key(server, auth)
        streamer, streamed = in_background(
            lambda: stream_lines(server, {**API_LONG, "stream": True}, auth)
        )
        poster, posted = in_background(
            lambda: httpx.post(
                f"{server.url}/v1/completions", json=API_LONG, headers=auth, timeout=60
            )
        )
        wait_for(lambda: server.gauge("vllm:num_requests_running") == 2, timeout=30)
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

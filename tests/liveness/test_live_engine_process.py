"""The liveness contract across the process boundary (`KVFLOW_ENGINE_PROCESS=1`: the engine
core in a child process). Killing the engine process is engine death: every client gets a
terminal answer, /health answers 503, the server exits 1 within 5 s and leaves no process.
Killing the API server takes the engine process with it (no orphan). With --api-server-count 2
three processes serve one port (output constraints included: parsed and compiled by the engine
process, whose refusal is the API server's 400; a client that leaves frees its blocks within
1 s; no API server maps libtorch or xgrammar), and SIGTERM ends all of them with every client
answered."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from support.live import geometry, serving, sse_lines, start
from support.serverproc import (
    ServerProcess,
    command_line,
    heavy_libraries,
    in_background,
    wait_for,
)

pytestmark = pytest.mark.placement("process")

FLAGS = geometry(16, 64)
LONG = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True}
DEATH_BOUND_S = 5.0
COLOURS = {"choice": ["red", "green", "blue"]}


def alive(pid: int) -> bool:
    """Running (a zombie, dead but not yet reaped, counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def stream_answer(server: ServerProcess, started: threading.Event) -> str:
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json={**LONG, "stream": True}, timeout=60
    ) as resp:
        lines = []
        for line in resp.iter_lines():
            if line:
                started.set()
                lines.append(line)
    error = any('"error"' in line for line in lines)
    return f"{resp.status_code} {'error event' if error else 'no error'} {lines[-1]}"


def plain_answer(server: ServerProcess) -> str:
    resp = server.post("/v1/completions", LONG)
    return f"{resp.status_code} {resp.json().get('error', {}).get('message', '')}"


def poll_health(server: ServerProcess) -> list[int | None]:
    """/health statuses until the server stops answering (None: refused or timed out)."""
    seen: list[int | None] = []
    with httpx.Client(base_url=server.url, timeout=5.0) as client:
        while server.proc.poll() is None:
            try:
                seen.append(client.get("/health").status_code)
            except httpx.HTTPError:
                seen.append(None)
                if server.proc.poll() is not None or seen[-3:] == [None] * 3:
                    break
            time.sleep(0.002)
    return seen


def test_killing_the_engine_process_is_engine_death() -> None:
    server = start(FLAGS)
    try:
        (engine_pid,) = server.children()
        started = threading.Event()
        streaming = in_background(lambda: stream_answer(server, started))
        plain = in_background(lambda: plain_answer(server))
        wait_for(lambda: server.gauge("vllm:num_requests_running") == 2, timeout=60)
        started.wait(30)
        server_pid = server.pid
        # Two keep-alive pollers: the 503 lasts until the server closes its listener (~0.1 s).
        pollers = [in_background(lambda: poll_health(server)) for _ in range(2)]
        killed = time.monotonic()
        os.kill(engine_pid, signal.SIGKILL)
        code = server.wait_exit(timeout=DEATH_BOUND_S + 10)
        exited = time.monotonic() - killed
        for thread, _ in pollers:
            thread.join(10)
        polls = [result.get("value", []) for _, result in pollers]
        for thread, _ in (streaming, plain):
            thread.join(10)
    finally:
        server.kill()
    answers = [streaming[1].get("value"), plain[1].get("value")]
    print(f"  engine SIGKILL: server exit {code} after {exited:.2f} s; answers {answers}")
    health = [status for seen in polls for status in seen]
    print(f"  /health after the kill: {health.count(503)} x 503, {health.count(200)} x 200 first")
    assert code == 1 and exited < DEATH_BOUND_S
    assert answers[0].startswith("200 error event data: [DONE]"), answers[0]
    assert answers[1].startswith("500 The engine process was killed"), answers[1]
    assert 503 in health
    assert all(200 not in seen[seen.index(503) :] for seen in polls if 503 in seen)
    assert not alive(server_pid) and not alive(engine_pid)


def test_killing_the_api_server_leaves_no_engine_process() -> None:
    server = start(FLAGS)
    try:
        (engine_pid,) = server.children()
        thread, _ = in_background(lambda: plain_answer(server))
        wait_for(lambda: server.gauge("vllm:num_requests_running") == 1, timeout=60)
        server.proc.send_signal(signal.SIGKILL)
        server.wait_exit(10)
        took = wait_for(lambda: not alive(engine_pid), timeout=5)
    finally:
        server.kill()
    print(f"  API server SIGKILL: the engine process gone {took:.2f} s later")


def test_api_server_count_2_serves_one_port_and_stops_together() -> None:
    with serving([*FLAGS, "--api-server-count", "2"]) as server:
        kids = server.children()
        assert len(kids) == 3, kids  # the engine and two API servers
        requests = [
            in_background(lambda: server.post("/v1/completions", {**LONG, "max_tokens": 8}))
            for _ in range(6)
        ]
        for thread, _ in requests:
            thread.join(120)
        codes = [result["value"].status_code for _, result in requests]
        assert codes == [200] * 6
        status, lines = sse_lines(server, {**LONG, "max_tokens": 4})
        assert status == 200 and lines[-1] == "data: [DONE]"
        # output constraints: parsed and compiled by the engine process
        chat = {"messages": [{"role": "user", "content": "Pick a colour."}], "max_tokens": 8}
        picked = server.post("/v1/chat/completions", {**chat, "structured_outputs": COLOURS})
        assert picked.status_code == 200, picked.text
        assert picked.json()["choices"][0]["message"]["content"] in COLOURS["choice"]
        bad = server.post("/v1/chat/completions", {**chat, "structured_outputs": {"regex": "("}})
        assert bad.status_code == 400 and "cannot be compiled" in bad.text, bad.text
        # the supervisor and the API servers serve text: neither torch nor xgrammar is mapped
        fronts = [
            p for p in [server.pid, *kids] if "kvflow.engine.core_proc" not in command_line(p)
        ]
        assert len(fronts) == 3 and [heavy_libraries(p) for p in fronts] == [[]] * 3
        # a client leaving mid-stream: the abort crosses and its blocks are free within 1 s
        with httpx.stream(
            "POST", f"{server.url}/v1/completions", json={**LONG, "stream": True}, timeout=60
        ) as resp:
            lines = resp.iter_lines()
            while not next(lines).startswith("data: "):
                pass
            wait_for(lambda: server.gauge("vllm:num_requests_running") == 1, timeout=30)
        left = time.monotonic()
        wait_for(server.idle, timeout=5.0, interval=0.02)
        freed = time.monotonic() - left
        started = threading.Event()
        streaming = in_background(lambda: stream_answer(server, started))
        wait_for(started.is_set, timeout=60)
        sent = server.signal(signal.SIGTERM)
        code = server.wait_exit(timeout=30)
        exited = time.monotonic() - sent
        streaming[0].join(10)
    answer = streaming[1].get("value", "")
    print(f"  --api-server-count 2: a left stream freed in {freed:.2f} s; SIGTERM -> exit {code}")
    print(f"  in {exited:.2f} s; stream: {answer}")
    assert code == 0 and exited < 10
    assert freed < 1.0, f"a disconnected stream's blocks were freed after {freed:.2f} s"
    assert answer.startswith("200 error event data: [DONE]"), answer
    assert not [k for k in kids if alive(k)]

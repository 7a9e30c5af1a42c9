"""The liveness contract on a card: a served engine under load, ended by SIGTERM or by the death
of its engine process, gives every client a terminal answer, exits within a bound with the
status the README states and leaves no process. gpu_serve.py ends each served model's run with
one of the two (`end_under_load`), on the server it has just measured.

A terminal answer is a stream that ends with `data: [DONE]` (after its finish reason, or after
an error event) or an HTTP error status; a stream cut without `[DONE]`, a reset connection or a
client still waiting after the bound is not.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx

EXIT_BOUND_S = 5.0  # the README's "within seconds"; CPU tests hold 2 s, a card tears down CUDA
EXPECTED_EXIT = {"sigterm": 0, "engine_killed": 1}
TERMINAL = ("done", "error event", "http error")


def alive(pid: int) -> bool:
    """Running (a zombie, dead but not yet reaped, counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def stream_one(url: str, body: dict, started: threading.Semaphore) -> str:
    """One streaming completion, classified by how it ended."""
    error, last, first = False, "", True
    try:
        with httpx.stream("POST", url, json=body, timeout=60) as resp:
            if resp.status_code != 200:
                resp.read()
                return "http error"
            for line in resp.iter_lines():
                if not line:
                    continue
                if first:
                    started.release()
                    first = False
                last = line
                if line.startswith("data: {"):
                    error |= "error" in json.loads(line[len("data: ") :])
    except httpx.HTTPError as err:
        return f"broken ({type(err).__name__})"
    finally:
        if first:
            started.release()  # never streamed: the waiter is not kept past its bound
    if last != "data: [DONE]":
        return "cut"
    return "error event" if error else "done"


def end_under_load(
    proc: subprocess.Popen, port: int, engine_pid: int, how: str, clients: int, max_tokens: int
) -> dict:
    """`clients` streams of `max_tokens` (ignore_eos) on the server at `port`; once each has its
    first chunk, `how` ("sigterm": the API server gets SIGTERM; "engine_killed": the engine
    process gets SIGKILL). Returns the trial's record, with `ok` per the contract."""
    url = f"http://127.0.0.1:{port}/v1/completions"
    body = {"prompt": "t5 t6 t7 t8", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    started = threading.Semaphore(0)
    answers: list[str] = []

    def client() -> None:
        answers.append(stream_one(url, body, started))

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    streaming = sum(started.acquire(timeout=max(deadline - time.monotonic(), 0)) for _ in threads)
    t0 = time.monotonic()
    if how == "sigterm":
        proc.send_signal(signal.SIGTERM)
    else:
        os.kill(engine_pid, signal.SIGKILL)
    try:
        code: int | None = proc.wait(EXIT_BOUND_S + 30)
    except subprocess.TimeoutExpired:
        code = None
        proc.kill()
    exited_s = time.monotonic() - t0
    while alive(engine_pid) and time.monotonic() - t0 < EXIT_BOUND_S + 30:
        time.sleep(0.01)
    gone_s = time.monotonic() - t0
    for t in threads:
        t.join(max(t0 + EXIT_BOUND_S + 30 - time.monotonic(), 0))
    kinds = collections.Counter(answers)
    kinds["still waiting"] = sum(t.is_alive() for t in threads)
    record = {
        "how": how,
        "clients": clients,
        "streaming_at_signal": streaming,
        "exit_code": code,
        "exit_s": exited_s,
        "engine_gone_s": gone_s,
        "answers": {k: v for k, v in kinds.items() if v},
        "processes_left": [p for p in (proc.pid, engine_pid) if alive(p)],
    }
    record["ok"] = (
        code == EXPECTED_EXIT[how]
        and max(exited_s, gone_s) < EXIT_BOUND_S
        and all(k in TERMINAL for k in record["answers"])
        and not record["processes_left"]
    )
    return record

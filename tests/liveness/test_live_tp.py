"""The contract with tensor-parallel ranks, on real `kvflow serve --tensor-parallel-size 2`
processes with real signals; ranks are found, and checked gone (no orphan, no zombie), in the
real process table (/proc): a rank process is `python -m kvflow.worker.tp_worker ... --parent
<server pid>`.

  - a rank SIGKILLed under load is engine death: every in-flight request gets a terminal
    error, /health never answers 200 again (503 while the server drains, then nothing), the
    server exits non-zero within 5 s, and no rank is left;
  - a rank that hangs (SIGSTOP) trips the watchdog (/health 503, a WARNING) until it runs
    again (SIGCONT); then SIGTERM drains the in-flight request and every rank ends;
  - with the engine core in its own process, that process owns the ranks, and SIGTERM under
    load (abort mode) answers every client and ends the engine process and every rank;
  - a rank that fails at start-up ends start-up with that rank's error;
  - a signal during start-up, while the ranks load, ends the server and every rank.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from support.live import geometry, spawn, sse_events, sse_lines
from support.serverproc import ServerProcess, in_background, wait_for

pytestmark = [pytest.mark.tp, pytest.mark.slow]

FLAGS = [*geometry(16, 64), "--tensor-parallel-size", "2"]
LONG = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True}
DEATH_BOUND_S = 5.0  # engine death: exit within this of the kill
EXIT_BOUND_S = 2.0  # SIGTERM: exit within this of the last answer (test_live_shutdown's bound)


_OWNERS: dict[int, set[int]] = {}  # server pid -> it and the children seen: rank parents


def ranks_of(server_pid: int) -> list[int]:
    """Pids of live (not zombie) rank processes started by the server or, in the engine
    process placement, by its engine process (a child seen by an earlier call counts after it
    has died), from /proc."""
    owners = _OWNERS.setdefault(server_pid, {server_pid})
    found: list[tuple[int, list[bytes]]] = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            args = (proc / "cmdline").read_bytes().split(b"\0")
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[1] == str(server_pid):  # ppid
            owners.add(int(proc.name))
        if b"kvflow.worker.tp_worker" in args and fields[0] != "Z":
            found.append((int(proc.name), args))
    return [pid for pid, args in found if any(str(o).encode() in args for o in owners)]


def gone(pid: int) -> bool:
    """Exited (a zombie not yet reaped counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


ONE_THREAD = {"OMP_NUM_THREADS": "1"}  # per rank (and for the server, which only schedules)


def start_tp(flags: list[str], env: dict[str, str] | None = None) -> ServerProcess:
    server = spawn(flags, {**ONE_THREAD, **(env or {})})
    server.wait_healthy()
    assert len(ranks_of(server.pid)) == 2
    return server


def health_samples(server: ServerProcess, stop_after: float) -> list[int | None]:
    """/health statuses polled over one keep-alive connection for `stop_after` seconds, or
    until nothing answers after a 503 (None: nothing answered)."""
    seen: list[int | None] = []
    end = time.monotonic() + stop_after
    with httpx.Client(base_url=server.url, timeout=5.0) as client:
        while time.monotonic() < end:
            try:
                seen.append(client.get("/health").status_code)
            except httpx.HTTPError:
                seen.append(None)
                if 503 in seen:
                    break
            time.sleep(0.002)
    return seen


def test_rank_killed_under_load_is_engine_death() -> None:
    server = start_tp(FLAGS)
    try:
        plain_thread, plain = in_background(lambda: server.post("/v1/completions", LONG))
        stream_thread, stream = in_background(lambda: sse_lines(server, LONG))
        wait_for(lambda: server.gauge("vllm:num_requests_running") == 2, timeout=60)
        victim = ranks_of(server.pid)[1]
        pollers = [in_background(lambda: health_samples(server, DEATH_BOUND_S)) for _ in "ab"]
        t0 = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        code = server.wait_exit(timeout=DEATH_BOUND_S + 10)
        exited = time.monotonic() - t0
        for thread in (plain_thread, stream_thread, *(t for t, _ in pollers)):
            thread.join(10)
        polled = [result["value"] for _, result in pollers]
        left = ranks_of(server.pid)
    finally:
        server.kill()
    print(f"  rank {victim} SIGKILLed: exit {code} after {exited:.2f} s")
    assert code != 0 and exited < DEATH_BOUND_S, server.log()[-3000:]
    assert plain["value"].status_code == 500
    assert "tensor-parallel rank" in plain["value"].json()["error"]["message"]
    status, lines = stream["value"]
    assert status == 200 and sse_events(lines)[-1]["error"]["code"] == 500
    # The drain after a death can be shorter than one poll, so a 503 is not always seen; what
    # must hold is that once /health stops answering 200 it never answers 200 again.
    for seen in polled:
        down = next(i for i, status in enumerate([*seen, None]) if status != 200)
        assert seen[down:] and 200 not in seen[down:], seen
    assert not left


def test_hung_rank_trips_the_watchdog_then_drain_ends_every_rank() -> None:
    server = start_tp([*FLAGS, "--watchdog-timeout", "1", "--shutdown-timeout", "60"])
    try:
        thread, result = in_background(
            lambda: server.post("/v1/completions", {**LONG, "max_tokens": 48})
        )
        wait_for(lambda: server.gauge("vllm:num_requests_running") == 1, timeout=60)
        ranks = ranks_of(server.pid)
        os.kill(ranks[1], signal.SIGSTOP)
        try:
            took = wait_for(lambda: server.health() == 503, timeout=30)
        finally:
            os.kill(ranks[1], signal.SIGCONT)
        wait_for(lambda: server.health() == 200, timeout=30)
        sent = server.signal(signal.SIGTERM)
        thread.join(120)
        answered = time.monotonic()
        code = server.wait_exit(timeout=30)
        after = time.monotonic() - answered
        left = ranks_of(server.pid)
    finally:
        server.kill()
    print(f"  rank stopped: /health 503 after {took:.2f} s; drained, exit {code} {after:.2f} s")
    print(f"  after the last answer ({answered - sent:.1f} s drain)")
    assert any("--watchdog-timeout" in ln for ln in server.log().splitlines() if "WARNING" in ln)
    body = result["value"].json()
    assert body["choices"][0]["finish_reason"] == "length", body
    assert code == 0 and after < EXIT_BOUND_S and not left


@pytest.mark.placement("process")
def test_sigterm_under_load_in_the_engine_process_layout_ends_every_process() -> None:
    """With the engine core in its own process that process starts
    and owns the ranks; SIGTERM under load (abort mode) answers every client and ends the
    engine process and every rank."""
    server = spawn(FLAGS, ONE_THREAD)
    try:
        server.wait_healthy()
        (engine,) = server.children()
        ranks = ranks_of(engine)
        parents = {Path(f"/proc/{r}/stat").read_text().rsplit(")", 1)[1].split()[1] for r in ranks}
        assert len(ranks) == 2 and parents == {str(engine)}  # the engine process's, not ours
        plain_thread, plain = in_background(lambda: server.post("/v1/completions", LONG))
        stream_thread, stream = in_background(lambda: sse_lines(server, LONG))
        wait_for(lambda: server.gauge("vllm:num_requests_running") == 2, timeout=60)
        server.signal(signal.SIGTERM)
        plain_thread.join(30)
        stream_thread.join(30)
        answered = time.monotonic()
        code = server.wait_exit(timeout=30)
        after = time.monotonic() - answered
        left = ranks_of(engine)
    finally:
        server.kill()
    print(f"  SIGTERM under load: both answered, exit {code} {after:.2f} s after the last")
    assert code == 0 and after < EXIT_BOUND_S and not left
    assert gone(engine)
    assert plain["value"].status_code in (500, 503) and "error" in plain["value"].json()
    status, lines = stream["value"]
    assert status == 200 and "error" in sse_events(lines)[-1]


def test_rank_failing_at_start_up_ends_start_up_with_its_error() -> None:
    server = spawn(FLAGS, {**ONE_THREAD, "KVFLOW_FAULT": "rankfail:1"})
    try:
        code = server.wait_exit(timeout=240)
        left = ranks_of(server.pid)
    finally:
        server.kill()
    log = server.log()
    assert code != 0 and not left
    assert "tensor-parallel rank 1 failed at start-up" in log, log[-3000:]
    assert "injected start-up failure of rank 1" in log


def test_signal_while_the_ranks_load_ends_everything() -> None:
    server = spawn(FLAGS, ONE_THREAD)
    try:
        wait_for(lambda: len(ranks_of(server.pid)) == 2, timeout=240, interval=0.1)
        time.sleep(1.0)  # the ranks are importing torch or loading their shards
        assert server.health() is None
        sent = server.signal(signal.SIGTERM)
        code = server.wait_exit(timeout=15)
        took = time.monotonic() - sent
        wait_for(lambda: not ranks_of(server.pid), timeout=2)
    finally:
        server.kill()
    assert code in (-signal.SIGTERM, 128 + signal.SIGTERM) and took < 10


def test_ranks_of_a_sigkilled_server_exit_on_their_own() -> None:
    """Nothing can stop the ranks of a server killed with SIGKILL but the ranks themselves:
    each sees its parent gone (`tp_worker.watch_parent`) and exits; none stays an orphan."""
    server = spawn(FLAGS, ONE_THREAD)
    try:
        wait_for(lambda: len(ranks_of(server.pid)) == 2, timeout=240, interval=0.1)
        server.signal(signal.SIGKILL)
        server.wait_exit(timeout=10)
        took = wait_for(lambda: not ranks_of(server.pid), timeout=5)
    finally:
        server.kill()
    print(f"  server SIGKILLed: its 2 ranks exited {took:.2f} s later")

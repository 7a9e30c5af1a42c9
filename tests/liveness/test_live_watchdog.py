"""Property 9 (P13/P14) against a real server with injected step faults (KVFLOW_FAULT): a
step that hangs past --watchdog-timeout logs a WARNING at default verbosity and turns /health
to 503 until it ends (then 200 again: the watchdog reports a stall, it does not kill); a step
that raises fails every in-flight request with a 500, turns /health to 503, and the process
exits 1 so a supervisor restarts it. The raise test ends the server, so it runs last."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from support.live import (
    ServerProcess,
    geometry,
    in_background,
    serving,
    sse_events,
    sse_lines,
    token_prompt,
    wait_for,
)

SLEEP_MARK, RAISE_MARK = 40124, 40125
SLEEP_S, WATCHDOG_S = 4.0, 1.0
LONG = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True}


@pytest.fixture(scope="module")
def faulty(placement: str) -> Iterator[ServerProcess]:
    flags = [*geometry(16, 64), "--watchdog-timeout", str(WATCHDOG_S)]
    env = {"KVFLOW_FAULT": f"sleep:{SLEEP_MARK}:{SLEEP_S},raise:{RAISE_MARK}"}
    with serving(flags, env) as server:
        yield server


class HealthPoller:
    """Polls /health on a thread, recording (time, status or None) until stopped."""

    def __init__(self, server: ServerProcess) -> None:
        self.server = server
        self.seen: list[tuple[float, int | None]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        with httpx.Client(base_url=self.server.url, timeout=5.0) as client:  # keep-alive
            while not self._stop.is_set():
                try:
                    status: int | None = client.get("/health").status_code
                except httpx.HTTPError:
                    status = None
                self.seen.append((time.monotonic(), status))
                time.sleep(0.002)

    def stop(self) -> list[tuple[float, int | None]]:
        self._stop.set()
        self._thread.join(10)
        return self.seen


def test_hung_step_warns_and_turns_health_503_until_it_ends(faulty: ServerProcess) -> None:
    hung = {"prompt": [*token_prompt(6), SLEEP_MARK], "max_tokens": 4}
    other_thread, other = in_background(
        lambda: faulty.post("/v1/completions", {**LONG, "max_tokens": 16})
    )
    wait_for(lambda: faulty.gauge("vllm:num_requests_running") == 1, timeout=30)
    poller = HealthPoller(faulty)
    t0 = time.monotonic()
    resp = faulty.post("/v1/completions", hung)
    took = time.monotonic() - t0
    wait_for(lambda: faulty.health() == 200, timeout=10)
    seen = poller.stop()
    other_thread.join(60)
    unhealthy = [t for t, status in seen if status == 503]
    assert unhealthy, "no 503 while the step hung"
    stalled = unhealthy[-1] - unhealthy[0]
    first_503 = unhealthy[0] - t0
    print(f"  hung step of {SLEEP_S:g} s: /health 503 from {first_503:.2f} s for {stalled:.2f} s")
    print(f"  (--watchdog-timeout {WATCHDOG_S:g}); requests answered after {took:.2f} s")
    assert WATCHDOG_S <= first_503 < SLEEP_S and stalled > 1.0
    warnings = [ln for ln in faulty.log().splitlines() if ln.startswith("WARNING")]
    assert any("--watchdog-timeout" in ln for ln in warnings), warnings
    assert resp.status_code == 200 and other["value"].status_code == 200
    assert seen[-1][1] == 200 and faulty.health() == 200


def test_step_exception_fails_every_request_and_exits_1(faulty: ServerProcess) -> None:
    plain_thread, plain = in_background(lambda: faulty.post("/v1/completions", LONG))
    stream_thread, stream = in_background(lambda: sse_lines(faulty, LONG))
    wait_for(lambda: faulty.gauge("vllm:num_requests_running") == 2, timeout=30)
    # Two pollers: the 503 lasts only until the server closes its listener (~0.1 s).
    pollers = [HealthPoller(faulty), HealthPoller(faulty)]
    t0 = time.monotonic()
    trigger = faulty.post(
        "/v1/completions", {"prompt": [*token_prompt(6), RAISE_MARK], "max_tokens": 4}
    )
    answered = time.monotonic()
    code = faulty.wait_exit(timeout=15)
    exited = time.monotonic() - t0
    seen = sorted((s for p in pollers for s in p.stop()), key=lambda sample: sample[0])
    plain_thread.join(10)
    stream_thread.join(10)
    for resp in (trigger, plain["value"]):
        assert resp.status_code == 500, resp.text
        assert "injected step failure" in resp.json()["error"]["message"]
    status, lines = stream["value"]
    assert status == 200 and sse_events(lines)[-1]["error"]["code"] == 500
    after = [s for t, s in seen if t >= answered][2:]  # a poll of each may straddle it
    dying = [s for t, s in seen if t > t0 and s != 200]
    print(f"  step exception: 3 requests answered 500; exit {code} {exited:.2f} s after;")
    print(f"  /health after the death: {dying.count(503)} x 503, then refused")
    assert code == 1 and exited < 10
    assert 503 in dying and 200 not in after
    assert "engine loop failed" in faulty.log()

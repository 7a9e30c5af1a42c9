"""Properties 5, 6, 10, 11 and 12 against one real server with faults injected on purpose
(src/kvflow/worker/faults.py): it advertises 64 tokens more than its pool can hold (a broken
invariant the stuck-head guard must catch), poisons the logits of requests carrying a marker
token, admits 2 running + 2 queued requests, and times requests out after 3 s.

Order matters inside this module only for the CPU figures: the idle measurement runs before
any request, the blocked one right after the guard has failed requests."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

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

NAN_MARK = 40123  # a token id: requests whose prompt contains it get NaN logits
BLOCK_SIZE, NUM_BLOCKS, OVERCOMMIT = 16, 9, 64
SERVABLE = (NUM_BLOCKS - 1) * BLOCK_SIZE  # 128
ADVERTISED = SERVABLE + OVERCOMMIT  # 192: the broken invariant
SERVER_TIMEOUT_S = 3.0
PATIENT = {"request_timeout": 60}  # every request but the timeout test's outlives the 3 s
IDLE_WINDOW_S = 10.0
CPU_LIMIT = 0.05  # of one core


@pytest.fixture(scope="module")
def faulty(placement: str) -> Iterator[ServerProcess]:
    flags = geometry(BLOCK_SIZE, NUM_BLOCKS)
    flags += ["--max-num-seqs", "2", "--max-num-queued-reqs", "2"]
    flags += ["--request-timeout", str(SERVER_TIMEOUT_S), "--log-engine-steps"]
    env = {"KVFLOW_FAULT": f"overcommit:{OVERCOMMIT},nan:{NAN_MARK}"}
    with serving(flags, env) as server:
        yield server


def steps_logged(server: ServerProcess) -> tuple[int, int]:
    """(all core-step lines, those with model_executed=0) in the log so far."""
    lines = re.findall(r"core-step .*model_executed=(\d)", server.log())
    return len(lines), lines.count("0")


def cpu_share(server: ServerProcess, seconds: float) -> tuple[float, int]:
    """(share of one core used over `seconds`, core-step lines logged meanwhile)."""
    steps0, cpu0, t0 = steps_logged(server)[0], server.cpu_seconds(), time.monotonic()
    time.sleep(seconds)
    cpu1, t1 = server.cpu_seconds(), time.monotonic()
    return (cpu1 - cpu0) / (t1 - t0), steps_logged(server)[0] - steps0


def test_idle_server_sleeps(faulty: ServerProcess) -> None:
    time.sleep(1.0)  # let start-up work (the first /health, metrics) settle
    share, steps = cpu_share(faulty, IDLE_WINDOW_S)
    print(f"  idle: {share:.2%} of a core over {IDLE_WINDOW_S:.0f} s, {steps} steps logged")
    assert share < CPU_LIMIT and steps == 0


def test_stuck_head_fails_with_500_error_log_and_metric(faulty: ServerProcess) -> None:
    models = faulty.client().models.list().data
    assert (models[0].model_extra or {})["max_model_len"] == ADVERTISED  # the injected lie
    before = faulty.metrics().value("kvflow:stuck_requests_failed_total")
    # A request that fits runs first; the stuck ones wait behind it, then fail one by one.
    ok_thread, ok = in_background(
        lambda: faulty.post(
            "/v1/completions", {"prompt": "Hi", "max_tokens": 20, "ignore_eos": True, **PATIENT}
        )
    )
    wait_for(lambda: faulty.gauge("vllm:num_requests_running") == 1, timeout=30)
    too_long = {"prompt": token_prompt(150), "max_tokens": 8, **PATIENT}
    plain_thread, plain = in_background(lambda: faulty.post("/v1/completions", too_long))
    status, lines = sse_lines(faulty, {**too_long, "prompt": token_prompt(150, offset=1)})
    # Fits at first, outgrows the pool after 28 tokens: tokens, then the error event.
    grows = {"prompt": token_prompt(100, offset=2), "max_tokens": 80, "ignore_eos": True}
    grow_status, grow_lines = sse_lines(faulty, {**grows, **PATIENT})
    ok_thread.join(60)
    plain_thread.join(60)
    assert ok["value"].status_code == 200
    assert ok["value"].json()["usage"]["completion_tokens"] == 20
    resp = plain["value"]
    assert resp.status_code == 500, resp.text
    error = resp.json()["error"]
    print(f"  stuck, non-streaming: 500 {error['message']!r}")
    assert error["type"] == "InternalServerError"
    for needle in ("cannot be scheduled", "150 tokens", f"max_model_len {ADVERTISED}"):
        assert needle in error["message"]
    assert status == 200 and sse_events(lines)[-1]["error"]["code"] == 500
    grow_events = sse_events(grow_lines)
    chunks = sum(1 for e in grow_events if e.get("choices"))
    assert grow_status == 200 and grow_events[-1]["error"]["code"] == 500
    assert 0 < chunks <= SERVABLE - 100 + 1, f"{chunks} chunks before the error"
    after = faulty.metrics().value("kvflow:stuck_requests_failed_total")
    errors = [ln for ln in faulty.log().splitlines() if ln.startswith("ERROR")]
    guard_lines = [ln for ln in errors if "cannot be scheduled" in ln]
    print(f"  stuck_requests_failed {before:.0f} -> {after:.0f}; ERROR lines {len(guard_lines)}")
    assert after - before == 3 and len(guard_lines) == 3
    assert all("free blocks of 16 tokens" in ln and "9 blocks" in ln for ln in guard_lines)
    assert faulty.health() == 200 and faulty.idle()


def test_server_with_failed_requests_sleeps(faulty: ServerProcess) -> None:
    """After the guard: no spin. The only empty steps in the whole log are the guard's own
    (one per failed request); none while the server waits."""
    share, steps = cpu_share(faulty, IDLE_WINDOW_S)
    total, empty = steps_logged(faulty)
    failed = faulty.metrics().value("kvflow:stuck_requests_failed_total")
    print(f"  after the guard: {share:.2%} of a core over {IDLE_WINDOW_S:.0f} s, {steps} steps;")
    print(f"  whole log: {total} steps, {empty} with model_executed=0, {failed:.0f} guard failures")
    assert share < CPU_LIMIT and steps == 0
    assert empty == failed


def test_nan_logits_fail_that_request_alone(faulty: ServerProcess) -> None:
    normal = {"prompt": "Once upon a time", "max_tokens": 16, "ignore_eos": True, **PATIENT}
    poisoned = {"prompt": [*token_prompt(8), NAN_MARK], "max_tokens": 16, **PATIENT}
    with ThreadPoolExecutor(4) as pool:
        plain = [pool.submit(faulty.post, "/v1/completions", normal) for _ in range(2)]
        bad = pool.submit(faulty.post, "/v1/completions", poisoned)
        bad_stream = pool.submit(sse_lines, faulty, poisoned)
        health = [faulty.health() for _ in range(5)]
        results = [f.result() for f in plain]
        bad_resp, (stream_status, lines) = bad.result(), bad_stream.result()
    assert bad_resp.status_code == 500, bad_resp.text
    message = bad_resp.json()["error"]["message"]
    print(f"  NaN request: 500 {message!r}; others {[r.status_code for r in results]}")
    assert "non-finite logits" in message
    assert stream_status == 200 and sse_events(lines)[-1]["error"]["code"] == 500
    for resp in results:
        assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 16
    assert health == [200] * 5 and faulty.health() == 200
    wait_for(faulty.idle, timeout=5)


def test_full_queue_is_503_with_retry_after_at_once_and_none_is_lost(faulty: ServerProcess) -> None:
    long = {"prompt": "Tell me a story", "max_tokens": 40, "ignore_eos": True, **PATIENT}
    short = {**long, "max_tokens": 4}
    success = "vllm:request_success_total"
    before = faulty.metrics().value(success)
    with ThreadPoolExecutor(4) as pool:
        admitted = [pool.submit(faulty.post, "/v1/completions", long) for _ in range(2)]
        wait_for(lambda: faulty.gauge("vllm:num_requests_running") == 2, timeout=30)
        admitted += [pool.submit(faulty.post, "/v1/completions", short) for _ in range(2)]
        wait_for(lambda: faulty.gauge("vllm:num_requests_waiting") == 2, timeout=30)
        t0 = time.monotonic()
        refused = faulty.post("/v1/completions", short)
        refused_in = time.monotonic() - t0
        refused_stream, _ = sse_lines(faulty, short)
        answers = [f.result() for f in admitted]
    print(f"  queue full: 503 in {refused_in * 1000:.0f} ms, admitted {len(answers)} all answered")
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert "--max-num-queued-reqs" in refused.json()["error"]["message"]
    assert refused_in < 1.0 and refused_stream == 503
    assert [a.status_code for a in answers] == [200] * 4
    assert [a.json()["usage"]["completion_tokens"] for a in answers] == [40, 40, 4, 4]
    assert faulty.metrics().value(success) - before == 4


def test_server_request_timeout_aborts_with_408_and_frees_blocks(faulty: ServerProcess) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": 120, "ignore_eos": True}
    t0 = time.monotonic()
    resp = faulty.post("/v1/completions", body)
    took = time.monotonic() - t0
    status, lines = sse_lines(faulty, body)
    freed = wait_for(faulty.idle, timeout=5)
    print(f"  --request-timeout {SERVER_TIMEOUT_S:g}: 408 after {took:.2f} s; idle {freed:.2f} s")
    assert resp.status_code == 408, resp.text
    assert f"timeout of {SERVER_TIMEOUT_S:g} s" in resp.json()["error"]["message"]
    assert SERVER_TIMEOUT_S <= took < SERVER_TIMEOUT_S + 10
    assert status == 200 and sse_events(lines)[-1]["error"]["code"] == 408
    assert faulty.health() == 200

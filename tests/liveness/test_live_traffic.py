"""Properties 2, 12 and 13 against one real server: an over-long prompt or too-large max_tokens
is a 400 before anything is queued (no metric moves) and nothing is silently truncated; a
per-request deadline ends the request with a terminal answer and frees its blocks; after a
mixed load with disconnects and timeouts, nothing runs or waits and no block is held (prefix-
cached blocks count as free)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from support.live import (
    LONG_WAIT,
    MODEL,
    PROMPT,
    ServerProcess,
    geometry,
    serving,
    sse_events,
    sse_lines,
    token_prompt,
    wait_for,
)

MAX_MODEL_LEN = 1008  # 64 blocks x 16, less the null block


@pytest.fixture(scope="module")
def live(placement: str) -> Iterator[ServerProcess]:
    with serving([*geometry(16, 64), "--max-num-seqs", "8"]) as server:
        yield server


def engine_metrics(server: ServerProcess) -> dict[tuple[str, frozenset], float]:
    return {
        k: v for k, v in server.metrics().samples.items() if k[0].startswith(("vllm:", "kvflow:"))
    }


def test_refused_requests_are_400_before_anything_is_queued(live: ServerProcess) -> None:
    long_text = "hello " * (MAX_MODEL_LEN + 50)
    chat = [{"role": "user", "content": "Hi"}]
    refused = [
        ("/v1/completions", {"prompt": long_text}),
        ("/v1/completions", {"prompt": token_prompt(MAX_MODEL_LEN), "max_tokens": 1}),
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": MAX_MODEL_LEN}),
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": MAX_MODEL_LEN, "stream": True}),
        ("/v1/completions", {"prompt": [PROMPT, long_text], "max_tokens": 4}),  # one of two
        ("/v1/chat/completions", {"messages": chat, "max_tokens": MAX_MODEL_LEN}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": long_text}]}),
    ]
    before = engine_metrics(live)
    for path, body in refused:
        resp = live.post(path, {"model": MODEL, **body})
        assert resp.status_code == 400, (path, body.keys(), resp.text)
        message = resp.json()["error"]["message"]
        assert str(MAX_MODEL_LEN) in message, message
    assert engine_metrics(live) == before, "a refused request moved a metric"
    print(f"  {len(refused)} refused requests: 400 each, no metric moved")


def test_long_valid_prompt_is_not_truncated(live: ServerProcess) -> None:
    text = "The quick brown fox jumps over the lazy dog. " * 90
    count = live.post("/tokenize", {"prompt": text}).json()["count"]
    assert MAX_MODEL_LEN // 2 < count < MAX_MODEL_LEN - 1
    for extra in ({"max_tokens": 1}, {}):
        resp = live.post("/v1/completions", {"prompt": text, **extra})
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["prompt_tokens"] == count
    ids = token_prompt(MAX_MODEL_LEN - 1)
    usage = live.post("/v1/completions", {"prompt": ids}).json()[
        "usage"
    ]  # max_tokens unset: the 1 token of room
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (len(ids), 1)
    print(f"  {count}-token text prompt and {len(ids)}-token id prompt counted in full")


def test_per_request_timeout_answers_408_and_frees_blocks(live: ServerProcess) -> None:
    body = {"prompt": PROMPT, "max_tokens": 900, "ignore_eos": True, "request_timeout": 1.0}
    t0 = time.monotonic()
    resp = live.post("/v1/completions", body)
    took = time.monotonic() - t0
    freed = wait_for(live.idle, timeout=2.0)
    status, lines = sse_lines(live, body)
    assert resp.status_code == 408 and "timeout of 1 s" in resp.json()["error"]["message"]
    assert status == 200 and sse_events(lines)[-1]["error"]["code"] == 408
    assert 1.0 <= took < 10
    freed = max(freed, wait_for(live.idle, timeout=2.0))
    print(f"  request_timeout 1: 408 after {took:.2f} s; blocks freed within {freed:.2f} s")


def stream_then_leave(server: ServerProcess, body: dict, chunks: int) -> str:
    url, body = f"{server.url}/v1/completions", {**body, "stream": True}
    with httpx.stream("POST", url, json=body, timeout=LONG_WAIT) as r:  # not httpx's 5 s
        for i, _ in enumerate(line for line in r.iter_lines() if line):
            if i + 1 >= chunks:
                return "left mid-stream"
    return "ended before leaving"


def give_up(server: ServerProcess, body: dict) -> str:
    try:
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=1.0)
    except httpx.ReadTimeout:
        return "gave up"
    return "answered first"


def mixed_load(live: ServerProcess) -> list[object]:
    shared = "You are a helpful assistant. Answer briefly and precisely. " * 4
    short = {"max_tokens": 12, "ignore_eos": True}
    long = {"max_tokens": 600, "ignore_eos": True}
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "stream": True}
    jobs = [
        lambda: sse_lines(live, {"prompt": shared + "One", **short}),
        lambda: sse_lines(live, {"prompt": shared + "Two", **short}),
        lambda: live.post("/v1/completions", {"prompt": shared + "Three", **short}),
        lambda: live.post("/v1/completions", {"prompt": shared + "Four", "n": 2, **short}),
        lambda: live.post(
            "/v1/completions", {"prompt": PROMPT, **short, "temperature": 0.8, "seed": 1}
        ),
        lambda: sse_lines(live, chat, "/v1/chat/completions"),
        lambda: stream_then_leave(live, {"prompt": shared + "Five", **long}, 3),
        lambda: stream_then_leave(live, {"prompt": shared + "Six", **long}, 5),
        lambda: give_up(live, {"prompt": shared + "Seven", **long}),
        lambda: live.post(
            "/v1/completions", {"prompt": shared + "Eight", **long, "request_timeout": 0.7}
        ),
        lambda: sse_lines(live, {"prompt": "Nine", **long, "request_timeout": 0.7}),
    ]
    with ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(lambda job: job(), jobs))


def test_mixed_load_with_disconnects_and_timeouts_ends_idle(live: ServerProcess) -> None:
    before = live.metrics()
    results = mixed_load(live)
    took = wait_for(live.idle, timeout=5.0)
    after = live.metrics()
    for result in results[:6]:
        status = result[0] if isinstance(result, tuple) else result.status_code  # type: ignore[union-attr]
        assert status == 200
    assert results[6:9] == ["left mid-stream", "left mid-stream", "gave up"]
    assert results[9].status_code == 408  # type: ignore[union-attr]
    assert sse_events(results[10][1])[-1]["error"]["code"] == 408  # type: ignore[index]
    hits = after.value("vllm:prefix_cache_hits_total") - before.value(
        "vllm:prefix_cache_hits_total"
    )
    aborted = after.value("vllm:request_success_total", finished_reason="abort") - before.value(
        "vllm:request_success_total", finished_reason="abort"
    )
    print(f"  {len(results)} clients (6 complete, 3 leave, 2 time out): idle {took:.2f} s after;")
    print(f"  {hits:.0f} prefix-cache hit tokens; {aborted:.0f} aborts counted; KV usage 0")
    assert hits > 0 and aborted == 5
    assert live.health() == 200

"""Real `kvflow serve` processes for the liveness tests: spawn one on 127.0.0.1 with any flags
and environment, read its log, metrics, CPU time and children from /proc, signal it.

The embedded model's directory in ~/.cache/kvflow (or $KVFLOW_CACHE) is shared by every start,
so a start costs the imports and the model load (~5-8 s on 2 cores).
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

# in_background and wait_for are re-exported for the tests.
from support.serverproc import (  # noqa: F401
    LABELS,
    MODEL,
    Metrics,
    ServerProcess,
    in_background,
    launch,
    scrape,
    wait_for,
)

PROMPT = "The capital of France is"
LONG_WAIT = 60.0  # a liveness bound: an answer within this instead of never


def geometry(block_size: int, num_blocks: int, *extra: str) -> list[str]:
    return [
        "--dtype",
        "float32",
        "--block-size",
        str(block_size),
        "--num-blocks",
        str(num_blocks),
        *extra,
    ]


def token_prompt(n: int, offset: int = 0) -> list[int]:
    """`n` ordinary token ids (no special tokens), distinct per `offset` from the first."""
    return [1000 + (offset * 977 + i * 7) % 30000 for i in range(n)]


def spawn(flags: list[str], env: dict[str, str] | None = None) -> ServerProcess:
    """Start `python -m kvflow.server.api_server` with `flags`; does not wait for it."""
    inherited = {k: v for k, v in os.environ.items() if k != "KVFLOW_FAULT"}
    return ServerProcess(*launch(flags, {**inherited, **(env or {})}, "kvflow-live-"))


def start(flags: list[str], env: dict[str, str] | None = None) -> ServerProcess:
    """Spawn a server and wait until /health answers 200 (fails the test otherwise)."""
    server = spawn(flags, env)
    server.wait_healthy()
    return server


@contextmanager
def serving(flags: list[str], env: dict[str, str] | None = None) -> Iterator[ServerProcess]:
    """A healthy server for the block; SIGTERM (then SIGKILL) at the end."""
    server = start(flags, env)
    try:
        yield server
    finally:
        if server.proc.poll() is None:
            server.signal()
            try:
                server.wait_exit(15)
            except subprocess.TimeoutExpired:
                pass
        server.kill()


# ---- clients -------------------------------------------------------------------------------


def sse_lines(
    server: ServerProcess, body: dict, path: str = "/v1/completions", timeout: float = LONG_WAIT
) -> tuple[int, list[str]]:
    """(status, non-empty lines) of a streamed request, read to the end."""
    with httpx.stream(
        "POST", f"{server.url}{path}", json={**body, "stream": True}, timeout=timeout
    ) as resp:
        return resp.status_code, [line for line in resp.iter_lines() if line]


def sse_events(lines: list[str]) -> list[dict]:
    """The JSON events of an SSE body that ends with `data: [DONE]` (asserted)."""
    assert lines and lines[-1] == "data: [DONE]", f"stream did not end with [DONE]: {lines[-3:]}"
    return [json.loads(line[len("data: ") :]) for line in lines[:-1]]

"""Real `kvflow serve` processes for the liveness tests: spawn one on 127.0.0.1 with any flags
and environment, read its log, metrics, CPU time and children from /proc, signal it.

The converted model in ~/.cache/kvflow (or $KVFLOW_CACHE) is shared by every start, so a start
costs the imports and the model load (~5-8 s on 2 cores), not a conversion.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
# in_background and wait_for are re-exported for the tests.
from server.serverproc import (  # noqa: E402, F401
    Metrics,
    ServerProcess,
    in_background,
    launch,
    scrape,
    wait_for,
)

MODEL = "SmolLM2-135M-Instruct"
LABELS = {"model_name": MODEL, "engine": "0"}
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


class Live(ServerProcess):
    """A server under a liveness test: the base's process handling plus metrics and /proc."""

    def post(self, body: dict, path: str = "/v1/completions", timeout: float = LONG_WAIT):
        return httpx.post(f"{self.url}{path}", json=body, timeout=timeout)

    def metrics(self) -> Metrics:
        return scrape(self)

    def gauge(self, name: str) -> float:
        return self.metrics().value(name, **LABELS)

    def idle(self) -> bool:
        """Nothing running or waiting, and no block held (prefix-cached blocks count as free)."""
        m = self.metrics()
        return (
            m.value("vllm:num_requests_running", **LABELS) == 0
            and m.value("vllm:num_requests_waiting", **LABELS) == 0
            and m.value("vllm:kv_cache_usage_perc", **LABELS) == 0
        )

    def cpu_seconds(self) -> float:
        """utime + stime of the server and its child processes (the engine core process),
        every thread, from /proc/<pid>/stat."""
        return sum(process_cpu_seconds(pid) for pid in [self.pid, *self.children()])

    def children(self) -> list[int]:
        """Pids of the process's children (from every thread's /proc children list)."""
        pids: list[int] = []
        for task in Path(f"/proc/{self.pid}/task").glob("*"):
            try:
                pids += [int(p) for p in (task / "children").read_text().split()]
            except OSError:
                pass
        return pids

    def num_threads(self) -> int:
        return len(list(Path(f"/proc/{self.pid}/task").glob("*")))


def process_cpu_seconds(pid: int) -> float:
    """utime + stime of one process (every thread); 0 once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def spawn(flags: list[str], env: dict[str, str] | None = None) -> Live:
    """Start `python -m kvflow.server.api_server` with `flags`; does not wait for it."""
    inherited = {k: v for k, v in os.environ.items() if k != "KVFLOW_FAULT"}
    return Live(*launch(flags, {**inherited, **(env or {})}, "kvflow-live-"))


def start(flags: list[str], env: dict[str, str] | None = None) -> Live:
    """Spawn a server and wait until /health answers 200 (fails the test otherwise)."""
    server = spawn(flags, env)
    server.wait_healthy()
    return server


@contextmanager
def serving(flags: list[str], env: dict[str, str] | None = None) -> Iterator[Live]:
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
    server: Live, body: dict, path: str = "/v1/completions", timeout: float = LONG_WAIT
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

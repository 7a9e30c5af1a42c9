"""Real `kvflow serve` processes for the liveness tests: spawn one on 127.0.0.1 with any flags
and environment, read its log, metrics, CPU time and children from /proc, signal it.

The converted model in ~/.cache/kvflow (or $KVFLOW_CACHE) is shared by every start, so a start
costs the imports and the model load (~5-8 s on 2 cores), not a conversion.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
# wait_for is re-exported for the tests.
from server.serverproc import Metrics, free_port, scrape, wait_for  # noqa: E402, F401

MODEL = "SmolLM2-135M-Instruct"
LABELS = {"model_name": MODEL, "engine": "0"}
PROMPT = "The capital of France is"
START_TIMEOUT_S = 240.0
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


@dataclass
class Live:
    proc: subprocess.Popen
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def client(self, timeout: float = LONG_WAIT) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.url}/v1", api_key="EMPTY", max_retries=0, timeout=timeout
        )

    def post(self, body: dict, path: str = "/v1/completions", timeout: float = LONG_WAIT):
        return httpx.post(f"{self.url}{path}", json=body, timeout=timeout)

    def health(self) -> int | None:
        """/health's status, or None when nothing answers."""
        try:
            return httpx.get(f"{self.url}/health", timeout=5.0).status_code
        except httpx.HTTPError:
            return None

    def metrics(self) -> Metrics:
        return scrape(self)  # type: ignore[arg-type]

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
        """utime + stime of the whole process (every thread), from /proc/<pid>/stat."""
        stat = Path(f"/proc/{self.pid}/stat").read_text()
        fields = stat[stat.rindex(")") + 2 :].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

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

    def signal(self, sig: int = signal.SIGTERM) -> float:
        sent = time.monotonic()
        self.proc.send_signal(sig)
        return sent

    def wait_exit(self, timeout: float) -> int:
        return self.proc.wait(timeout=timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


def spawn(flags: list[str], env: dict[str, str] | None = None) -> Live:
    """Start `python -m kvflow.server.api_server` with `flags`; does not wait for it."""
    port = free_port()
    fd, log_name = tempfile.mkstemp(prefix="kvflow-live-", suffix=".log")
    os.close(fd)
    cmd = [sys.executable, "-m", "kvflow.server.api_server", "--port", str(port), *flags]
    inherited = {k: v for k, v in os.environ.items() if k != "KVFLOW_FAULT"}
    full_env = {**inherited, "PYTHONUNBUFFERED": "1", **(env or {})}
    with open(log_name, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env)
    return Live(proc, port, Path(log_name))


def start(flags: list[str], env: dict[str, str] | None = None) -> Live:
    """Spawn a server and wait until /health answers 200 (fails the test otherwise)."""
    server = spawn(flags, env)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            pytest.fail(f"server exited with {server.proc.returncode}:\n{server.log()[-3000:]}")
        if server.health() == 200:
            return server
        time.sleep(0.1)
    server.kill()
    pytest.fail(f"server did not become healthy:\n{server.log()[-3000:]}")


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


def in_background(fn: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    """Run `fn` on a daemon thread; its value (or exception) lands in the returned dict."""
    result: dict[str, Any] = {}

    def target() -> None:
        try:
            result["value"] = fn()
        except Exception as exc:  # surfaced by the test's asserts
            result["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, result


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

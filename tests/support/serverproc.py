"""Helpers for end-to-end tests: the real server as a subprocess on 127.0.0.1, /metrics
scraping, polling.

The first start converts the embedded GGUF model into ~/.cache/kvflow (up to a minute); later
starts reuse it. JSON answers fetched through `ServerProcess.get/post` are recorded so
test_openapi can check them against /openapi.json.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

GEOMETRY = ["--dtype", "float32", "--num-blocks", "128", "--block-size", "16"]
MAX_MODEL_LEN = 1024
START_TIMEOUT_S = 240.0
MODEL = "SmolLM2-135M-Instruct"
LABELS = {"model_name": MODEL, "engine": "0"}  # the engine's metric labels
# Where a server's engine loop runs: a thread of the API server, or the engine core process.
PLACEMENTS = ("thread", "process")


def placement_env(placement: str) -> dict[str, str]:
    return {"KVFLOW_ENGINE_PROCESS": "1" if placement == "process" else "0"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class ServerProcess:
    """A `kvflow serve` subprocess on 127.0.0.1 whose output goes to `log_path`."""

    proc: subprocess.Popen
    port: int
    log_path: Path
    # JSON answers of `post` and `get`, for test_openapi's check against /openapi.json
    received: list[tuple[str, str, int, object]] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def client(self, api_key: str = "EMPTY", timeout: float = 60.0) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=timeout
        )

    def health(self) -> int | None:
        """/health's status, or None when nothing answers."""
        try:
            return httpx.get(f"{self.url}/health", timeout=5.0).status_code
        except httpx.HTTPError:
            return None

    def wait_healthy(self) -> None:
        """Until /health answers 200; fails the test if the process exits or takes too long."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"server exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            if self.health() == 200:
                return
            time.sleep(0.1)
        self.kill()
        pytest.fail(f"server did not become healthy:\n{self.log()[-3000:]}")

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

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it has not exited within 15 s (a fixture's teardown; the
        timeout still fails it)."""
        self.signal()
        try:
            self.wait_exit(15)
        finally:
            self.kill()

    def post(self, path: str, body: dict, timeout: float = 60.0, **kwargs) -> httpx.Response:
        """POST JSON to `path`; the answer is recorded (see `received`)."""
        response = httpx.post(f"{self.url}{path}", json=body, timeout=timeout, **kwargs)
        self.record("post", path, response)
        return response

    def get(self, path: str, **kwargs) -> httpx.Response:
        response = httpx.get(f"{self.url}{path}", timeout=30.0, **kwargs)
        self.record("get", path, response)
        return response

    def record(self, method: str, path: str, response: httpx.Response) -> None:
        if response.headers.get("content-type", "").startswith("application/json"):
            self.received.append((method, path, response.status_code, response.json()))

    # ---- /metrics and /proc --------------------------------------------------------------

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
        """utime + stime of the server and its child processes (an engine core process),
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


def launch(
    args: list[str], env: dict[str, str], log_prefix: str
) -> tuple[subprocess.Popen, int, Path]:
    """Start `python -m kvflow.server.api_server --port <free> *args` with `env`, its output
    in a fresh temp file; does not wait. Returns (process, port, log path)."""
    port = free_port()
    fd, log_name = tempfile.mkstemp(prefix=log_prefix, suffix=".log")
    os.close(fd)
    cmd = [sys.executable, "-m", "kvflow.server.api_server", "--port", str(port), *args]
    with open(log_name, "w") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env={**env, "PYTHONUNBUFFERED": "1"}
        )
    return proc, port, Path(log_name)


def start_server(
    *extra: str, geometry: list[str] | None = None, placement: str | None = None
) -> ServerProcess:
    """A healthy server with the suite's geometry; `placement` None: as the environment says."""
    env = {**os.environ, **(placement_env(placement) if placement else {})}
    args = [
        *(geometry or [*GEOMETRY, "--max-model-len", str(MAX_MODEL_LEN)]),
        "--uvicorn-log-level",
        "warning",
        *extra,
    ]
    server = ServerProcess(*launch(args, env, "kvflow-server-"))
    server.wait_healthy()
    return server


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


# ---- /metrics ------------------------------------------------------------------------------

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


@dataclass
class Metrics:
    text: str
    samples: dict[tuple[str, frozenset], float]

    def value(self, name: str, **labels: str) -> float:
        """The sum over the samples of `name` whose labels include `labels`."""
        want = set(labels.items())
        found = [v for (n, ls), v in self.samples.items() if n == name and want <= ls]
        assert found, f"no sample {name}{labels}"
        return sum(found)

    def type_of(self, name: str) -> str | None:
        match = re.search(rf"^# TYPE {re.escape(name)} (\w+)$", self.text, re.MULTILINE)
        return match.group(1) if match else None


def scrape(server: ServerProcess) -> Metrics:
    text = httpx.get(f"{server.url}/metrics", timeout=30.0).text
    samples = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match and not line.startswith("#"):
            labels = frozenset(_LABEL.findall(match.group(2) or ""))
            samples[(match.group(1), labels)] = float(match.group(3))
    return Metrics(text, samples)


def wait_for(predicate, timeout: float, interval: float = 0.05) -> float:
    """Poll until predicate() is true; returns the seconds it took (fails on timeout)."""
    start = time.monotonic()
    while True:
        if predicate():
            return time.monotonic() - start
        if time.monotonic() - start > timeout:
            raise AssertionError(f"condition not met within {timeout} s")
        time.sleep(interval)


def process_cpu_seconds(pid: int) -> float:
    """utime + stime of one process (every thread); 0 once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# Shared libraries an API server over the engine process must not map: torch's, xgrammar's and
# the FFI runtime xgrammar loads.
HEAVY_LIBRARIES = ("libtorch", "xgrammar", "tvm_ffi")


def heavy_libraries(pid: int) -> list[str]:
    """The HEAVY_LIBRARIES files mapped in process `pid` (/proc/<pid>/maps)."""
    paths = {line.split()[-1] for line in Path(f"/proc/{pid}/maps").read_text().splitlines()}
    return sorted(p for p in paths if any(name in p for name in HEAVY_LIBRARIES))


def resident_mib(pid: int) -> float:
    """VmRSS of process `pid`, in MiB (/proc/<pid>/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


def command_line(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")

"""A port that another socket listens on ends `kvflow serve` at once: a non-zero exit and one
line naming host:port, before any model is loaded (its cache stays empty) and
before "serving at" is printed."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

CLI = ["-m", "kvflow.cli", "serve"]
# `kvflow serve` binds before its heavy imports (under a second on an idle host); the module
# entry that the tests and benchmarks start imports the server first (seconds).
CASES = {
    "kvflow serve": (CLI, 10.0),
    "kvflow serve --api-server-count 2": ([*CLI, "--api-server-count", "2"], 10.0),
    "python -m kvflow.server.api_server": (["-m", "kvflow.server.api_server"], 60.0),
}


@pytest.fixture
def listener():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.mark.parametrize("case", CASES)
def test_a_busy_port_fails_before_the_model_loads(listener, tmp_path: Path, case):
    argv, bound_s = CASES[case]
    env = {**os.environ, "KVFLOW_CACHE": str(tmp_path / "cache")}
    cmd = [sys.executable, *argv, "--port", str(listener), "--dtype", "float32"]
    start = time.monotonic()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    took = time.monotonic() - start
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1, output
    assert took < bound_s, f"{case} took {took:.1f} s to fail"
    assert output.strip() == (
        f"kvflow serve: error: cannot listen on 127.0.0.1:{listener}: Address already in use "
        "(another server is there: choose another --port)"
    )
    assert not (tmp_path / "cache").exists()  # the embedded model was never resolved
    print(f"  {case}: exit 1 after {took:.2f} s")

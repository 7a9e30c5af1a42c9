"""`benchmarks/gpu_check.py --smoke` cut short by `timeout`'s SIGTERM keeps what it did (its
whole dry run is tests/gpu/test_card_run.py's)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"


def test_a_run_cut_short_by_sigterm_keeps_what_it_did(tmp_path) -> None:
    """`timeout` ends a run that overran with SIGTERM: the report written so far stays, with
    every finished model, and the partial table is printed."""
    out = tmp_path / "report.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", KVFLOW_NATIVE="0")
    cmd = [sys.executable, str(SCRIPT), "--smoke", "--skip-kernel", "--out", str(out)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 200
    while time.monotonic() < deadline and proc.poll() is None:  # a model's parity passed
        with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):  # mid-write
            if any(p["ok"] for p in json.loads(out.read_text()).get("parity", [])):
                break
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    stdout, _ = proc.communicate(timeout=60)
    assert proc.returncode == 124
    report = json.loads(out.read_text())
    assert report["stopped_by_signal"] == signal.SIGTERM
    assert report["parity"][0]["model"] == "smollm2-shape" and report["parity"][0]["ok"]
    assert "| model |" in stdout

"""`benchmarks/host_overhead.py` runs end to end against a baseline commit and prints its table
(so the script cannot rot; the figures themselves mean nothing at this size)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_side_by_side_with_a_baseline_commit() -> None:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs the git checkout to export the baseline from")
    cmd = [sys.executable, str(ROOT / "benchmarks" / "host_overhead.py"), "--baseline", "HEAD"]
    cmd += ["--batches", "1,3", "--steps", "3", "--warm", "1", "--repeats", "1", "--penalty"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [x for x in proc.stdout.splitlines() if x.startswith("| ")]
    assert "baseline host" in lines[0] and "current host" in lines[0] and "ratio" in lines[0]
    rows = [x.strip("| ").split(" | ") for x in lines[1:]]
    assert [r[0] for r in rows] == ["1", "3"]
    for r in rows:
        assert all(float(v) > 0 for v in r[1:5]) and r[-1].endswith("x")


def test_simulated_device_compares_sync_and_async_scheduling() -> None:
    """With a simulated device of 20 ms a step, async scheduling hides the host's work: a step
    costs the device's time, not the sum (a bound with room: the host's work here is ~1 ms)."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "host_overhead.py"), "--device-ms", "20,20"]
    cmd += ["--batches", "1,3", "--steps", "5", "--warm", "1", "--repeats", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [x for x in proc.stdout.splitlines() if x.startswith("| ")]
    assert "sync step" in lines[0] and "async step" in lines[0]
    rows = [x.strip("| ").split(" | ") for x in lines[1:]]
    assert [r[0] for r in rows] == ["1", "3"]
    for _, device_ms, sync_ms, async_ms, _ in rows:
        assert float(sync_ms) > float(device_ms) and float(async_ms) >= float(device_ms) * 0.95
        assert float(async_ms) < float(sync_ms)

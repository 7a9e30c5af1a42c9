"""`benchmarks/gpu_check.py --smoke` runs end to end (on the CPU here: the Triton kernel under
the interpreter, the engine with its padded decode path run eagerly) and reports passing checks
and a full timing table, in its output and in the JSON it writes."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"


def test_smoke_run(tmp_path) -> None:
    out = tmp_path / "report.json"
    # One thread, and torch's paths instead of the native CPU kernels: this checks the script,
    # not CPU speed, and must not wait for a kernel build.
    env = dict(os.environ, OMP_NUM_THREADS="1", KVFLOW_NATIVE="0")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["ok"] and report["smoke"]
    kernel = report["kernel"]
    # skipped only where triton is absent; else three attention cases, then 4 fused small ops
    # x 2 dtypes x 2 token counts
    has_triton = importlib.util.find_spec("triton") is not None
    assert ("skipped" in kernel) == (not has_triton), kernel
    if has_triton:
        assert kernel["ok"] and len(kernel["cases"]) == 3 + 16
    assert [p["model"] for p in report["parity"]] == ["smollm2-shape", "llama-1b-shape"]
    for parity in report["parity"]:
        assert parity["fp32_tokens_equal"] and parity["bf16_logits_ok"], parity
        assert parity["graph_replay"]["ok"] and parity["graph_replay"]["capture_clean"]
    decode = [r for r in report["timing"] if r["unit"] == "ms/step"]
    assert len(decode) == 4 and all(r["graph_steps"] > 0 for r in decode)
    assert all(r["kvflow_graphs"] > 0 and r["floor_ms"] > 0 for r in decode)
    assert all(r["kvflow_graphs_sync"] > 0 for r in decode)
    assert report["copy_bandwidth_gbs"] > 0
    assert report["table"] in proc.stdout
    assert len(report["table"].splitlines()) == 2 + 6  # header + 2 x (2 decode + 1 prefill)


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

"""`benchmarks/gpu_serve.py --smoke` runs end to end on the CPU (one tiny shape served through a
real `kvflow serve` with its engine process, beside the offline engine; the 8B shape's decode
rows at toy size), so that the card run cannot fail on a typo."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_serve.py"


def test_smoke_run(tmp_path) -> None:
    out = tmp_path / "report.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", KVFLOW_NATIVE="0")
    cmd = [sys.executable, str(SCRIPT), "--smoke", "--models", "smollm2-shape", "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    (served,) = report["served"]
    assert served["model"] == "smollm2-shape" and served["offline_tok_s"] > 0
    assert [r["concurrency"] for r in served["served"]] == [1, 4]
    for row in served["served"]:
        assert row["errors"] == 0 and row["tok_s"] > 0
        assert row["cpu_us_per_tok"]["api"] > 0 and row["cpu_us_per_tok"]["engine"] > 0
    assert [r["batch"] for r in report["llama_8b"]] == [1, 4]
    assert all(r["step_ms"] > 0 and r["floor_ms"] > 0 for r in report["llama_8b"])
    assert report["table"] in proc.stdout

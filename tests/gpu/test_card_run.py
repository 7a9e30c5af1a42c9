"""`benchmarks/card_run.sh --dry-run`: the standing card run, every part on the CPU at toy sizes
(Triton under its interpreter), so that a card's few minutes are never lost to a typo. Each
part leaves the report a card run leaves, and this checks what each report must hold:
gpu_check's kernel cases, parity and timing table; gpu_serve's served levels beside the offline
engine and both liveness trials (SIGTERM, engine SIGKILL) passing; the 8B part's decode rows with
a quantized method beside bfloat16; the CUDA test selections still naming tests."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("card")
    env = dict(os.environ, OUT=str(out), PYTHON=sys.executable)
    proc = subprocess.run(
        ["bash", "benchmarks/card_run.sh", "--dry-run"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, proc.stdout


def test_every_part_ran_in_order(dry_run) -> None:
    out, stdout = dry_run
    parts = re.findall(r"^== (\w+) ", stdout, re.M)
    assert parts == ["check", "serve", "big", "tests", "done"], stdout[-2000:]
    assert (out / "card.txt").read_text().startswith("no card: dry run")


def test_check_part(dry_run) -> None:
    out, stdout = dry_run
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["ok"] and report["smoke"] and report["triton_interpreter"]
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
    assert report["table"] in stdout
    assert len(report["table"].splitlines()) == 2 + 6  # header + 2 x (2 decode + 1 prefill)


def test_serve_part_with_both_liveness_trials(dry_run) -> None:
    out, _ = dry_run
    report = json.loads((out / "gpu_serve.json").read_text())
    assert [e["model"] for e in report["served"]] == ["smollm2-shape", "llama-1b-shape"]
    for entry in report["served"]:
        assert entry["offline_tok_s"] > 0 and entry["ok"], entry
        assert [r["concurrency"] for r in entry["served"]] == [1, 4]
        for row in entry["served"]:
            assert row["errors"] == 0 and row["tok_s"] > 0
            assert row["cpu_us_per_tok"]["api"] > 0 and row["cpu_us_per_tok"]["engine"] > 0
    trials = {e["liveness"]["how"]: e["liveness"] for e in report["served"]}
    assert set(trials) == {"sigterm", "engine_killed"}
    for trial in trials.values():
        assert trial["ok"] and trial["streaming_at_signal"] == trial["clients"], trial
        assert trial["exit_code"] == (0 if trial["how"] == "sigterm" else 1)
        assert sum(trial["answers"].values()) == trial["clients"] and not trial["processes_left"]
    assert "llama_8b" not in report  # the big part's, in its own report


def test_big_part_times_bf16_and_quantized_decode(dry_run) -> None:
    out, _ = dry_run
    report = json.loads((out / "gpu_8b.json").read_text())
    assert report["served"] == []
    assert [r["batch"] for r in report["llama_8b"]] == [1, 4]
    assert all(r["step_ms"] > 0 and r["floor_ms"] > 0 for r in report["llama_8b"])
    quantized = report["llama_8b_quantized"]
    assert quantized["method"] == "int8"  # fp8 on a card; the CPU's quantized method here
    assert [r["batch"] for r in quantized["rows"]] == [1, 4]
    assert all(r["speedup_over_bf16"] > 0 for r in quantized["rows"])
    assert 0 <= quantized["greedy_agreement"] <= 1


def test_tests_part_selections_name_tests(dry_run) -> None:
    out, _ = dry_run
    for log in ("tests_first.log", "tests_rest.log"):
        text = (out / log).read_text()
        (collected,) = re.findall(r"^(\d+)(?:/\d+)? tests? collected", text, re.M)
        assert int(collected) > 0, text[-1000:]
        assert "error" not in text.lower().splitlines()[-1], text[-1000:]

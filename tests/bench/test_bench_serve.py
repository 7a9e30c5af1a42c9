"""`kvflow bench serve` against a real `kvflow serve` subprocess."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvflow.bench import free_port, running_server, serve

MAX_MODEL_LEN = 512
STARTUP_TIMEOUT_S = 300.0
METRICS = ("ttft", "tpot", "itl", "e2el")
FIELDS = (
    "date",
    "completed",
    "errors",
    "error_messages",
    "duration",
    "num_prompts",
    "max_concurrency",
    "input_len",
    "output_len",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "load_generator_cpu_s",
    *(f"{stat}_{m}_ms" for m in METRICS for stat in ("mean", "median", "std", "p90", "p99")),
)


@pytest.fixture(scope="module")
def server_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real `kvflow serve`, healthy before the first test and stopped after the last."""
    port = free_port()
    cmd = [sys.executable, "-m", "kvflow.cli", "serve", "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--num-blocks", "64", "--block-size", "16"]
    cmd += ["--max-model-len", str(MAX_MODEL_LEN), "--dtype", "float32"]
    log = tmp_path_factory.mktemp("server") / "server.log"
    server = running_server(cmd, port, log, timeout=STARTUP_TIMEOUT_S, ready_path="/health")
    with server as (url, _pid):
        yield url


def _bench(url: str, result_file: Path, *flags: str) -> tuple[int, dict[str, Any]]:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    argv = ["--base-url", url, "--result-file", str(result_file), "--disable-tqdm", *flags]
    rc = serve.main(parser.parse_args(argv))
    return rc, json.loads(result_file.read_text())


def test_small_load_reports_every_field(server_url: str, tmp_path: Path) -> None:
    flags = ["--input-len", "16", "--output-len", "8", "--num-prompts", "6"]
    rc, result = _bench(server_url, tmp_path / "ok.json", *flags, "--max-concurrency", "3")
    assert rc == 0, result["error_messages"]
    assert set(FIELDS) <= set(result)
    assert result["completed"] == 6
    assert result["errors"] == 0 and result["error_messages"] == []
    assert result["total_output_tokens"] == 6 * 8
    assert result["total_input_tokens"] == 6 * 16  # prompts are token-exact
    assert (result["max_concurrency"], result["input_len"], result["output_len"]) == (3, 16, 8)
    assert result["duration"] > 0 and result["output_throughput"] > 0
    assert result["total_token_throughput"] > result["output_throughput"]
    assert 0 < result["load_generator_cpu_s"] < 60
    for metric in METRICS:
        assert result[f"mean_{metric}_ms"] > 0
        assert result[f"median_{metric}_ms"] <= result[f"p99_{metric}_ms"]
    assert result["mean_ttft_ms"] <= result["mean_e2el_ms"]
    assert result["p99_ttft_ms"] <= result["p99_e2el_ms"]


def test_failed_requests_are_counted_not_raised(server_url: str, tmp_path: Path) -> None:
    too_long = str(MAX_MODEL_LEN + 88)
    flags = ["--input-len", too_long, "--output-len", "8", "--num-prompts", "4"]
    rc, result = _bench(server_url, tmp_path / "fail.json", *flags, "--max-concurrency", "2")
    assert rc == 1
    assert result["errors"] == 4 and result["completed"] == 0
    assert result["total_output_tokens"] == 0
    assert result["error_messages"] and all("400" in m for m in result["error_messages"])

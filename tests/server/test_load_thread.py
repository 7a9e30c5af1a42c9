"""`kvflow serve` (its API server, or its engine process: `engine/startup.py`) loads the model on
a thread that exits, so the engine loop's OpenMP pool is the process's only one (with a second pool left on the main thread, libgomp stops spinning between
regions and decode steps ran 1.6x slower: benchmarks/RESULTS.md)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# Counts the process's threads after a load through the server's loader, then after a load on
# the calling thread itself: each load runs parallel regions (weight packing, the profiling
# forward), and libgomp keeps a pool of workers for a thread that ran one until it exits.
PROBE = """
import argparse, os
import numpy, torch  # their own thread pools start at import, before the first count
from kvflow.engine.startup import load_core
from kvflow.server.args import add_serve_arguments, engine_args_from
from kvflow.engine.llm_engine import LLMEngine

args = add_serve_arguments(argparse.ArgumentParser()).parse_args(
    ["--num-blocks", "64", "--max-model-len", "256", "--max-num-batched-tokens", "256"]
)
threads = lambda: len(os.listdir("/proc/self/task"))
before = threads()
load_core(engine_args_from(args))
after_loader = threads()
LLMEngine.from_args(engine_args_from(args))
print(before, after_loader, threads())
"""


def run_probe(code: str, values: int) -> tuple[list[int], str]:
    """The last `values` integers a probe prints (in a fresh process), and its output."""
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    return [int(v) for v in done.stdout.split()[-values:]], done.stdout + done.stderr


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one core: OpenMP starts no workers")
def test_server_loader_leaves_no_openmp_pool_behind() -> None:
    (before, after_loader, after_direct), output = run_probe(PROBE, 3)
    assert after_loader == before, output
    assert after_direct > after_loader  # the same load on this thread leaves its workers


FREEZE_PROBE = """
import argparse, gc
from kvflow.engine.startup import load_core
from kvflow.server.args import add_serve_arguments, engine_args_from

args = add_serve_arguments(argparse.ArgumentParser()).parse_args(
    ["--num-blocks", "64", "--max-model-len", "256", "--max-num-batched-tokens", "256"]
)
load_core(engine_args_from(args))
print(gc.get_freeze_count(), len(gc.get_objects()))
"""


def test_server_loader_freezes_what_the_load_made() -> None:
    """The load's objects are out of the collector's reach: a full collection (Python runs
    them as serving's objects come and go) has a few thousand left to scan, not ~300k
    (142 ms each for the embedded model)."""
    (frozen, tracked), output = run_probe(FREEZE_PROBE, 2)
    assert frozen > 100_000 and tracked < frozen // 20, output

"""The tensor-parallel flags: vLLM's spellings onto EngineArgs, bad values refused by name
before anything starts, head counts the ranks cannot share refused with the numbers."""

from __future__ import annotations

import argparse

import pytest
from transformers import LlamaConfig

from kvflow.engine.llm_engine import EngineArgs
from kvflow.model.tensor_parallel import check_divisible
from kvflow.server.args import add_serve_arguments, engine_args_from


def _args(*argv: str) -> EngineArgs:
    return engine_args_from(add_serve_arguments(argparse.ArgumentParser()).parse_args(argv))


def test_flags_map_onto_engine_args() -> None:
    args = _args("--tensor-parallel-size", "2", "--distributed-executor-backend", "ray")
    assert args.tensor_parallel_size == 2 and args.distributed_executor_backend == "ray"
    assert _args("-tp", "4").tensor_parallel_size == 4
    defaults = _args()
    assert defaults.tensor_parallel_size == 1 and defaults.distributed_executor_backend is None


def test_bad_values_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size must be at least 1"):
        EngineArgs(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="distributed_executor_backend must be mp or ray"):
        EngineArgs(distributed_executor_backend="slurm")


def test_more_ranks_than_query_heads_is_refused_with_the_numbers() -> None:
    smol = LlamaConfig(num_attention_heads=9, num_key_value_heads=3, hidden_size=576)
    for world in (2, 3, 4, 9):
        check_divisible(smol, world)
    with pytest.raises(ValueError, match="tensor_parallel_size 10 is too large for 9"):
        check_divisible(smol, 10)


def test_async_scheduling_under_tensor_parallelism_is_refused_by_name() -> None:
    """`kvflow serve -tp 2 --async-scheduling`: every rank runs each step eagerly, so the flag
    cannot be honoured; the command exits 2 naming both flags, before any rank starts."""
    import os
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "kvflow.cli", "serve", "--port", "0", "--dtype", "float32"]
    cmd += ["--tensor-parallel-size", "2", "--async-scheduling"]
    env = {**os.environ, "KVFLOW_ENGINE_PROCESS": "0"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "--async-scheduling is not available with --tensor-parallel-size" in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("kvflow serve: error: --async")

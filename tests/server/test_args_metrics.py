"""Unit tests without a server: the CLI flags map onto EngineArgs with vLLM's spellings, and
ServerMetrics turns engine stats into vLLM's metric families."""

from __future__ import annotations

import argparse

import pytest

from kvflow.config import CacheConfig, EngineConfig, SchedulerConfig
from kvflow.engine.async_stats import FinishedRequestStats, IterationStats
from kvflow.engine.engine_core import EngineStats
from kvflow.server.args import add_serve_arguments, engine_args_from, parse_bytes
from kvflow.server.metrics import ServerMetrics, build_1_2_5_buckets


def parse(*argv: str) -> argparse.Namespace:
    return add_serve_arguments(argparse.ArgumentParser()).parse_args(list(argv))


def test_defaults():
    args = parse()
    assert (args.host, args.port, args.shutdown_timeout) == ("127.0.0.1", 8000, 0.0)
    engine = engine_args_from(args)
    assert engine.model is None and engine.max_model_len is None
    assert engine.enable_prefix_caching and engine.block_size == 16


def test_vllm_spellings_map_onto_engine_args():
    args = parse(
        "some/model",
        "--served-model-name",
        "a",
        "b",
        "--num-gpu-blocks-override",
        "4",
        "--max-model-len",
        "auto",
        "--kv-cache-memory",
        "2G",
        "--no-enable-prefix-caching",
        "--dtype",
        "half",
        "--max-num-seqs",
        "8",
        "--max-num-batched-tokens",
        "64",
        "--seed",
        "3",
    )
    engine = engine_args_from(args)
    assert engine.model == "some/model" and engine.served_model_name == "a"
    assert engine.num_blocks == 4 and engine.max_model_len == -1
    assert engine.kv_cache_memory == 2 << 30 and not engine.enable_prefix_caching
    assert engine.dtype == "float16" and engine.max_num_seqs == 8
    assert engine.max_num_batched_tokens == 64 and engine.seed == 3
    assert parse("--num-blocks", "7").num_blocks == 7
    assert parse("--model", "m").model == "m"
    assert parse("--max-model-len", "-1").max_model_len == -1
    assert parse("--max-model-len", "2k").max_model_len == 2000


def test_log_engine_steps_from_env(monkeypatch):
    monkeypatch.setenv("KVFLOW_LOG_ENGINE_STEPS", "1")
    assert engine_args_from(parse()).log_engine_steps


@pytest.mark.parametrize(
    ("text", "value"),
    [("1000", 1000), ("2G", 2 << 30), ("2GiB", 2 << 30), ("2GB", 2 * 10**9), ("512m", 512 * 10**6)],
)
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


def test_conflicting_models_are_refused():
    with pytest.raises(ValueError, match="two models"):
        engine_args_from(parse("a", "--model", "b"))


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--block-size", "0"], "block_size must be at least 1, got 0"),
        (["--max-num-seqs", "0"], "max_num_seqs must be at least 1, got 0"),
        (["--max-num-batched-tokens", "0"], "max_num_batched_tokens must be at least 1"),
        (["--gpu-memory-utilization", "2"], "gpu_memory_utilization must be in (0, 1], got 2"),
    ],
)
def test_impossible_engine_flags_are_refused_by_name(argv, needle):
    """What vLLM's config refuses: before anything loads (--block-size 0 was a
    ZeroDivisionError at KV sizing; --max-num-seqs 0 started and failed every request)."""
    with pytest.raises(ValueError) as info:
        engine_args_from(parse(*argv))
    assert needle in str(info.value)


def test_negative_shutdown_timeout_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        parse("--shutdown-timeout", "-1")
    assert info.value.code == 2 and "must be >= 0" in capsys.readouterr().err


def test_cli_reports_a_bad_value_in_one_line(capsys):
    from kvflow.cli import main

    assert main(["generate", "Hi", "--model", "/nonexistent/model"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kvflow generate: error: ")


def engine_stats(**changes) -> EngineStats:
    values = dict(
        num_running=0,
        num_waiting=0,
        num_waiting_for_capacity=0,
        kv_cache_usage=0.0,
        num_preemptions_total=0,
        prefix_cache_queries=0,
        prefix_cache_hits=0,
        num_stuck_failures=0,
        num_steps=0,
    )
    return EngineStats(**{**values, **changes})


def test_metrics_record_gauges_counters_histograms():
    config = EngineConfig(CacheConfig(16, 9), SchedulerConfig(128, 256, 4))
    metrics = ServerMetrics("m", config, 0.9)
    stats = IterationStats(
        engine=engine_stats(num_running=1, num_waiting=3, num_waiting_for_capacity=2),
        num_iteration_tokens=7,
        num_prompt_tokens=5,
        num_generation_tokens=2,
        num_preemptions=1,
        time_to_first_tokens=[0.2],
        finished=[FinishedRequestStats("stop", 1.0, 0.1, 5, 2)],
    )
    metrics.record(stats)
    text = metrics.render().decode()
    labels = 'engine="0",model_name="m"'
    assert f"vllm:num_requests_waiting{{{labels}}} 3.0" in text
    assert f'vllm:num_requests_waiting_by_reason{{{labels},reason="capacity"}} 2.0' in text
    assert f'vllm:num_requests_waiting_by_reason{{{labels},reason="deferred"}} 1.0' in text
    assert f"vllm:num_preemptions_total{{{labels}}} 1.0" in text
    success = 'engine="0",finished_reason="stop",model_name="m"'
    assert f"vllm:request_success_total{{{success}}} 1.0" in text
    assert f"vllm:iteration_tokens_total_sum{{{labels}}} 7.0" in text
    assert "# TYPE vllm:time_to_first_token_seconds histogram" in text


def test_token_buckets_follow_1_2_5():
    assert build_1_2_5_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert build_1_2_5_buckets(1024)[-1] == 1000

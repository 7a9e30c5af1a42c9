"""The zero-cost runner behind `KVFLOW_NULL_RUNNER`: under the real scheduler (chunked prefill,
preemption of a pool too small for every request) each request gets exactly its max_tokens of
the fixed token, one per step once its prompt is computed, and the pool ends clean."""

from __future__ import annotations

import pytest

from kvflow.config import CacheConfig, EngineConfig, SchedulerConfig
from kvflow.core.request import Request
from kvflow.engine.engine_core import EngineCore
from kvflow.worker import null_runner
from kvflow.worker.null_runner import NullRunner


def test_every_request_gets_its_tokens_through_chunking_and_preemption() -> None:
    cache = CacheConfig(block_size=4, num_blocks=12)  # 44 tokens: not all requests fit at once
    core = EngineCore(EngineConfig(cache, SchedulerConfig(40, 8, 4)), NullRunner(100, 7))
    lengths = {f"r{i}": (5 + 3 * i, 6 + i) for i in range(5)}  # (prompt, max_tokens)
    for rid, (prompt, max_tokens) in lengths.items():
        core.scheduler.add_request(Request(rid, list(range(10, 10 + prompt)), max_tokens))
    got: dict[str, list[int]] = {rid: [] for rid in lengths}
    finished = set()
    for _ in range(500):
        if not core.has_unfinished_requests():
            break
        for out in core.step():
            got[out.req_id] += out.new_token_ids
            if out.finish_reason is not None:
                finished.add(out.req_id)
    assert finished == set(lengths)
    assert got == {rid: [99] * max_tokens for rid, (_, max_tokens) in lengths.items()}
    assert core.scheduler.num_preemptions_total > 0  # the pool was too small: it preempted
    core.scheduler.kv.pool.check_invariants()
    assert core.scheduler.kv.usage == 0.0


def test_from_env(monkeypatch) -> None:
    inner = object()
    monkeypatch.delenv(null_runner.ENV, raising=False)
    assert null_runner.from_env(inner, 100, 2) is inner
    monkeypatch.setenv(null_runner.ENV, "0.002")
    runner = null_runner.from_env(inner, 100, 99)
    assert isinstance(runner, NullRunner) and runner.step_s == 0.002 and runner.token == 98
    monkeypatch.setenv(null_runner.ENV, "fast")
    with pytest.raises(ValueError, match="seconds per step"):
        null_runner.from_env(inner, 100, 2)

"""AsyncEngine over its engine loop on a thread (`ThreadCore`), the core a real EngineCore with
a scripted runner (no model, no torch work): what the front end promises in either placement.

Placement: the thread alone, because the scripted runner lives in this process; under tests the
thread's messages pass through the engine process's encoding (`ThreadCore`), and the engine
process itself is tested in tests/engine/test_core_process.py and the liveness suite."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time

import pytest

from kvflow.engine.async_llm import AsyncEngine, EngineDeadError, EngineUnavailableError
from kvflow.engine.async_stats import IterationStats, StepWatchdog
from kvflow.sampling_params import SamplingParams
from support.fake_engine import SlowRunner, make_front_end

PROMPT = list(range(10, 20))


class Recorder:
    def __init__(self) -> None:
        self.stats: list[IterationStats] = []

    def record(self, stats: IterationStats) -> None:
        self.stats.append(stats)


@pytest.fixture(autouse=True, params=[False, True], ids=["sync", "async-scheduling"])
def async_scheduling(request, monkeypatch) -> None:
    """Every test twice: steps applied as they end, and each step scheduled while the previous
    one runs (the GPU default: a step returns the previous step's outputs)."""
    monkeypatch.setattr(sys.modules[__name__], "ASYNC_SCHEDULING", request.param)


ASYNC_SCHEDULING = False


def make_engine(max_num_seqs: int = 8, **kwargs) -> tuple[AsyncEngine, SlowRunner, Recorder]:
    watchdog = kwargs.get("watchdog_timeout", 0.0)
    engine, runner = make_front_end(max_num_seqs=max_num_seqs, watchdog_timeout=watchdog)
    engine.core.core.async_scheduling = ASYNC_SCHEDULING
    recorder = Recorder()
    return AsyncEngine(engine, stat_logger=recorder, **kwargs), runner, recorder


def params(max_tokens: int = 5, n: int = 1) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, n=n, ignore_eos=True, detokenize=False)


async def wait_until(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_generate_streams_deltas_and_records_stats():
    async def main():
        engine, _, recorder = make_engine()
        engine.start()
        outputs = [o async for o in engine.generate("r1", PROMPT, params(5, n=2))]
        await engine.shutdown(0)
        engine.close()
        return engine, outputs, recorder

    engine, outputs, recorder = run(main())
    assert outputs[-1].finished and not any(o.finished for o in outputs[:-1])
    tokens = {
        i: sum(len(c.token_ids) for o in outputs for c in o.outputs if c.index == i) for i in (0, 1)
    }
    assert tokens == {0: 5, 1: 5}
    assert {str(c.finish_reason) for c in outputs[-1].outputs} <= {"length"}
    assert sum(s.num_generation_tokens for s in recorder.stats) == 10
    assert sum(s.num_prompt_tokens for s in recorder.stats) == len(PROMPT)
    finished = [f for s in recorder.stats for f in s.finished]
    assert [(f.finish_reason, f.num_generation_tokens) for f in finished] == [("length", 10)]
    assert not engine.threads_alive()


def test_queue_time_ends_at_the_first_scheduling():
    """vLLM's queue time: arrival to first scheduling, not to the step that reported the first
    token (with async scheduling a step later). `b` waits for `a` (one running slot)."""

    async def main():
        engine, runner, recorder = make_engine(max_num_seqs=1)
        runner.delay = 0.2
        engine.start()
        a = asyncio.ensure_future(engine.generate("a", PROMPT, params(2)).__anext__())
        await asyncio.sleep(0)
        b = [o async for o in engine.generate("b", PROMPT, params(1))]
        await a
        await engine.shutdown(0)
        return b, recorder

    b, recorder = run(main())
    assert b[-1].finished
    queued = {f.num_generation_tokens: f.queued_time for s in recorder.stats for f in s.finished}
    assert queued[2] < 0.1  # a: scheduled by the first step
    assert queued[1] >= 0.3  # b: behind a's two steps


def test_validation_error_raises_before_anything_is_queued():
    async def main():
        engine, _, _ = make_engine()
        engine.start()
        with pytest.raises(ValueError, match="maximum context length is 256 tokens"):
            engine.add_request("long", list(range(300)), params())
        with pytest.raises(ValueError, match="too large: 500"):
            engine.add_request("big", PROMPT, params(max_tokens=500))
        stats = await engine.call_utility("stats")  # after everything sent before it
        await engine.shutdown(0)
        return engine, stats

    engine, stats = run(main())
    assert engine.client.adds_sent == 0, "a refused request must not reach the engine loop"
    assert stats["num_waiting"] == stats["num_running"] == 0


def test_a_request_is_validated_once_on_its_way_to_the_core():
    """AsyncEngine validates, then sends the params `validate` returned: with max_tokens unset
    they run to the rest of the context, checked once."""

    async def main():
        engine, _, _ = make_engine()
        checked = []
        validate = engine.engine.validate
        engine.engine.validate = lambda ids, p: checked.append(len(ids)) or validate(ids, p)
        engine.start()
        unset = SamplingParams(max_tokens=None, n=2, ignore_eos=True, detokenize=False)
        outputs = [o async for o in engine.generate("r1", list(range(250)), unset)]
        await engine.shutdown(0)
        return checked, outputs

    checked, outputs = run(main())
    assert checked == [250]
    tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    assert tokens == 2 * (256 - 250)


def test_a_batch_of_prompts_is_refused_whole():
    """`add_requests` (a completions prompt list): one prompt refused by validation sends none;
    a queue that fills part way aborts the ones sent, which end with a terminal output."""

    async def main():
        engine, _, _ = make_engine(max_num_seqs=1, max_num_queued_reqs=0)
        engine.start()
        with pytest.raises(ValueError, match="maximum context length"):
            engine.add_requests(
                ["a", "b"], [PROMPT, list(range(300))], [params(), params()], [None, None]
            )
        sent_after_refusal = engine.client.adds_sent
        with pytest.raises(EngineUnavailableError):
            engine.add_requests(
                ["c", "d"], [PROMPT, PROMPT], [params(200), params(200)], [None, None]
            )
        assert not engine.request_ids()
        stats = await engine.call_utility("stats")
        await engine.shutdown(0)
        return sent_after_refusal, stats

    sent_after_refusal, stats = run(main())
    assert sent_after_refusal == 0
    assert stats["num_waiting"] == stats["num_running"] == 0


def test_what_cannot_cross_the_wire_fails_on_the_thread_too():
    """Under tests ThreadCore passes every message through the engine process's msgspec
    encoding: a field the wire cannot carry (bytes where a str goes) is refused here as over
    the process, and the engine goes on serving."""

    async def main():
        engine, _, _ = make_engine()
        engine.start()
        bad = SamplingParams(max_tokens=3, stop=[b"x"], ignore_eos=True, detokenize=False)
        with pytest.raises(ValueError, match=r"sampling_params\.stop"):
            engine.add_request("bad", PROMPT, bad)
        outputs = [o async for o in engine.generate("good", PROMPT, params(3))]
        await engine.shutdown(0)
        return outputs

    assert os.environ.get("KVFLOW_WIRE_CHECK") == "1"  # tests/conftest.py
    assert run(main())[-1].finished


def test_idle_engine_sleeps_instead_of_stepping():
    async def main():
        engine, _, recorder = make_engine()
        engine.start()
        _ = [o async for o in engine.generate("r1", PROMPT, params(3))]
        await asyncio.sleep(0.05)
        before = (len(recorder.stats), engine.stats().num_steps)
        cpu0 = time.process_time()
        await asyncio.sleep(0.5)
        after = (len(recorder.stats), engine.stats().num_steps)
        cpu = time.process_time() - cpu0
        await engine.shutdown(0)
        return before, after, cpu

    before, after, cpu = run(main())
    assert before == after, "the engine loop woke up while idle"
    assert cpu < 0.1


def test_closing_the_iterator_aborts_and_frees_blocks():
    async def main():
        engine, _, _ = make_engine()
        engine.start()
        gen = engine.generate("r1", PROMPT, params(200))
        seen = 0
        async for _ in gen:
            seen += 1
            if seen == 3:
                break
        await gen.aclose()
        await wait_until(lambda: engine.stats().num_running == 0, timeout=1.0)
        stats = engine.stats()
        await engine.shutdown(0)
        return stats

    stats = run(main())
    assert stats.kv_cache_usage == 0.0 and stats.num_waiting == 0


def test_cancelled_consumer_aborts():
    async def main():
        engine, _, _ = make_engine()
        engine.start()

        async def consume():
            async for _ in engine.generate("r1", PROMPT, params(200)):
                pass

        task = asyncio.create_task(consume())
        await wait_until(lambda: engine.stats().num_running == 1)
        task.cancel()
        await wait_until(lambda: engine.stats().num_running == 0, timeout=1.0)
        usage = engine.stats().kv_cache_usage
        await engine.shutdown(0)
        return usage

    assert run(main()) == 0.0


def test_shutdown_zero_aborts_in_flight_and_refuses_new():
    async def main():
        engine, _, _ = make_engine()
        engine.start()
        stream = engine.add_request("r1", PROMPT, params(200))
        await wait_until(lambda: engine.stats().num_running == 1)
        t0 = time.monotonic()
        await engine.shutdown(0)
        engine.close()
        elapsed = time.monotonic() - t0
        outputs = [o async for o in stream]
        with pytest.raises(EngineUnavailableError, match="shutting down"):
            engine.add_request("r2", PROMPT, params())
        return engine, outputs, elapsed

    engine, outputs, elapsed = run(main())
    assert outputs[-1].finished
    assert str(outputs[-1].outputs[-1].finish_reason) == "abort"
    assert elapsed < 2.0
    assert not engine.threads_alive()
    assert not engine.is_healthy


def test_shutdown_with_timeout_drains_in_flight():
    async def main():
        engine, _, _ = make_engine()
        engine.start()
        stream = engine.add_request("r1", PROMPT, params(30))
        collected = asyncio.create_task(_collect(stream))
        await wait_until(lambda: engine.stats().num_running == 1)
        shutdown = asyncio.create_task(engine.shutdown(30))
        await wait_until(lambda: not engine.accepting)
        with pytest.raises(EngineUnavailableError):
            engine.add_request("r2", PROMPT, params())
        outputs = await collected
        await shutdown
        return outputs

    outputs = run(main())
    assert str(outputs[-1].outputs[-1].finish_reason) == "length"
    assert sum(len(c.token_ids) for o in outputs for c in o.outputs) == 30


async def _collect(stream):
    return [o async for o in stream]


def test_step_exception_fails_every_request_and_marks_dead():
    async def main():
        engine, runner, _ = make_engine()
        engine.start()
        streams = [engine.add_request(f"r{i}", PROMPT, params(200)) for i in range(3)]
        await wait_until(lambda: engine.stats().num_running == 3)
        runner.boom = True
        error = await asyncio.wait_for(engine.wait_dead(), 5)
        results = [await _collect(s) for s in streams]
        with pytest.raises(EngineDeadError):
            engine.add_request("late", PROMPT, params())
        healthy = engine.is_healthy
        await engine.shutdown(0)
        engine.close()
        return engine, error, results, healthy

    engine, error, results, healthy = run(main())
    assert "injected step failure" in error
    for outputs in results:
        last = outputs[-1]
        assert last.finished and str(last.outputs[-1].finish_reason) == "error"
        assert "injected step failure" in last.metrics["error"]
    assert not healthy and not engine.threads_alive()


def test_max_num_queued_reqs_refuses_with_retry_after():
    async def main():
        engine, _, _ = make_engine(max_num_seqs=1, max_num_queued_reqs=1)
        engine.start()
        first = engine.add_request("r1", PROMPT, params(200))
        await wait_until(lambda: engine.stats().num_running == 1)
        second = engine.add_request("r2", PROMPT, params(3))
        with pytest.raises(EngineUnavailableError) as info:
            engine.add_request("r3", PROMPT, params(3))
        engine.abort("r1")
        aborted = await _collect(first)
        assert str(aborted[-1].outputs[-1].finish_reason) == "abort"
        done = await _collect(second)
        await engine.shutdown(0)
        return info.value, done

    err, done = run(main())
    assert err.retry_after == 1 and "--max-num-queued-reqs" in str(err)
    assert str(done[-1].outputs[-1].finish_reason) == "length"


def test_queue_limit_counts_only_requests_that_will_wait():
    """A burst into free running slots does not queue: with --max-num-queued-reqs 0 an idle
    engine still runs max_num_seqs requests, and refuses only the one that would wait."""

    async def main():
        engine, _, _ = make_engine(max_num_seqs=2, max_num_queued_reqs=0)
        engine.start()
        try:
            streams = [engine.add_request(f"r{i}", PROMPT, params(3)) for i in range(2)]
            with pytest.raises(EngineUnavailableError):
                engine.add_request("r2", PROMPT, params(3))
            return [await _collect(s) for s in streams]
        finally:
            await engine.shutdown(0)

    for outputs in run(main()):
        assert str(outputs[-1].outputs[-1].finish_reason) == "length"


def test_watchdog_marks_a_long_step_unhealthy(caplog):
    async def main():
        engine, runner, _ = make_engine(watchdog_timeout=0.2)
        runner.delay = 0.6
        engine.start()
        stream = engine.add_request("r1", PROMPT, params(2))
        await wait_until(lambda: engine.stalled, timeout=2.0)
        healthy_during = engine.is_healthy
        await _collect(stream)
        healthy_after = engine.is_healthy
        await engine.shutdown(0)
        engine.close()
        return healthy_during, healthy_after

    with caplog.at_level("WARNING", logger="kvflow.engine"):
        during, after = run(main())
    assert not during and after
    assert any("--watchdog-timeout" in r.message for r in caplog.records)
    assert not any(t.name.startswith("kvflow-") for t in threading.enumerate())


def test_watchdog_catches_a_long_step_begun_while_it_waits_on_a_deadline(caplog):
    """Back-to-back short steps leave the watcher waiting on the first one's deadline, and a
    step's start does not wake it then: a long step begun meanwhile is still caught, at its own
    deadline, and the watcher is idle again once steps stop."""
    dog = StepWatchdog(0.3)
    try:
        with caplog.at_level("WARNING", logger="kvflow.engine"):
            for _ in range(5):
                dog.begin()
                time.sleep(0.02)
                dog.end()
            dog.begin()  # the long step
            began = time.monotonic()
            while not any("--watchdog-timeout" in r.message for r in caplog.records):
                assert time.monotonic() - began < 3.0, "the long step was never reported"
                time.sleep(0.01)
            assert dog.stalled and time.monotonic() - began >= 0.3
            dog.end()
        assert not dog.stalled
    finally:
        assert not dog.stop(2.0).is_alive()


def test_call_utility_runs_an_engine_method_between_steps():
    from kvflow.engine.engine_core import EngineStats

    async def main():
        engine, _, _ = make_engine()
        engine.start()
        stream = engine.add_request("u", PROMPT, params(50))
        await stream.__anext__()
        stats = await engine.call_utility("stats", type=EngineStats)
        with pytest.raises(RuntimeError, match="no engine method"):
            await engine.call_utility("no_such_method")
        await engine.shutdown(0)
        return stats

    stats = run(main())
    assert isinstance(stats, EngineStats) and stats.num_running == 1

"""What the AsyncEngine's loop reports per pass (scheduler snapshots, per-request timings), and
the watchdog that notices a step running too long.

Plain data only (it crosses the engine-thread boundary). `StatsTracker` lives on the engine
thread: it follows each request from arrival to its terminal output and turns a pass's outputs
and the engine's cumulative counters into one `IterationStats` of deltas.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol

from kvflow.engine.engine_core import EngineStats
from kvflow.outputs import RequestOutput

logger = logging.getLogger("kvflow.engine")


@dataclass(frozen=True)
class FinishedRequestStats:
    """vLLM's intervals: queued (arrival to first scheduled), prefill (to the first token),
    decode (first to last token), inference (first scheduled to last token); time per output
    token is decode over the longest choice's tokens after its first."""

    finish_reason: str
    e2e_latency: float
    queued_time: float
    num_prompt_tokens: int
    num_generation_tokens: int
    prefill_time: float = 0.0
    decode_time: float = 0.0
    inference_time: float = 0.0
    time_per_output_token: float = 0.0
    n: int = 1
    max_tokens: int | None = None
    max_choice_tokens: int = 0
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens read from the prefix cache

    @property
    def prefill_kv_computed_tokens(self) -> int:
        return max(self.num_prompt_tokens - self.num_cached_tokens, 0)


@dataclass
class IterationStats:
    """One pass of the engine loop. Counter fields are deltas since the previous pass."""

    engine: EngineStats
    num_iteration_tokens: int | None = None  # None when no step ran in this pass
    step_seconds: float | None = None  # the step's wall time; None when no step ran
    num_prompt_tokens: int = 0
    num_cached_prompt_tokens: int = 0  # of num_prompt_tokens, read from the prefix cache
    num_generation_tokens: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_stuck_failures: int = 0
    num_grammar_failures: int = 0  # requests failed by their output constraint
    grammar_compile_times: list[float] = field(default_factory=list)  # per constrained request
    estimated_flops: int = 0
    estimated_read_bytes: int = 0
    estimated_write_bytes: int = 0
    kv_events_dropped: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)


class StatLogger(Protocol):
    def record(self, stats: IterationStats) -> None: ...


@dataclass
class _Track:
    n: int
    num_prompt_tokens: int
    arrival: float
    max_tokens: int | None = None
    scheduled_at: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    per_choice: dict[int, int] = field(default_factory=dict)  # choice index -> its tokens


class StatsTracker:
    """Per-request timing, owned by the engine thread.

    Queue time is measured up to the request's first scheduling (vLLM's definition), which its
    first output reports (else the start of the step that reported it).
    """

    def __init__(self, initial: EngineStats) -> None:
        self._prev = initial
        self._tracks: dict[str, _Track] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._tracks

    def live(self) -> list[str]:
        return list(self._tracks)

    def live_choices(self) -> dict[str, int]:
        return {request_id: t.n for request_id, t in self._tracks.items()}

    def arrive(
        self,
        request_id: str,
        n: int,
        num_prompt_tokens: int,
        arrival: float,
        max_tokens: int | None = None,
    ) -> None:
        self._tracks[request_id] = _Track(n, num_prompt_tokens, arrival, max_tokens)

    def iteration(
        self,
        engine: EngineStats,
        outputs: list[RequestOutput],
        step_start: float | None,
        step_tokens: int | None,
    ) -> IterationStats:
        now = time.monotonic()
        prev, self._prev = self._prev, engine
        stats = IterationStats(
            engine=engine,
            num_iteration_tokens=step_tokens if step_start is not None else None,
            step_seconds=None if step_start is None else now - step_start,
            num_preemptions=engine.num_preemptions_total - prev.num_preemptions_total,
            prefix_cache_queries=engine.prefix_cache_queries - prev.prefix_cache_queries,
            prefix_cache_hits=engine.prefix_cache_hits - prev.prefix_cache_hits,
            num_stuck_failures=engine.num_stuck_failures - prev.num_stuck_failures,
            estimated_flops=engine.estimated_flops - prev.estimated_flops,
            estimated_read_bytes=engine.estimated_read_bytes - prev.estimated_read_bytes,
            estimated_write_bytes=engine.estimated_write_bytes - prev.estimated_write_bytes,
            kv_events_dropped=engine.kv_events_dropped - prev.kv_events_dropped,
            num_grammar_failures=engine.num_grammar_failures - prev.num_grammar_failures,
        )
        for output in outputs:
            self._observe(stats, output, now, now if step_start is None else step_start)
        return stats

    def _observe(
        self, stats: IterationStats, output: RequestOutput, now: float, step_start: float
    ) -> None:
        track = self._tracks.get(output.request_id)
        if track is None:
            return
        new_tokens = sum(len(c.token_ids) for c in output.outputs)
        track.num_preemptions += output.metrics.get("num_preemptions", 0)
        for c in output.outputs:
            track.per_choice[c.index] = track.per_choice.get(c.index, 0) + len(c.token_ids)
        if new_tokens:
            if track.last_token is None:
                track.scheduled_at = output.metrics.get("first_scheduled_time", step_start)
                track.first_token = now
                stats.time_to_first_tokens.append(now - track.arrival)
                stats.num_prompt_tokens += track.num_prompt_tokens
                track.num_cached_tokens = min(output.num_cached_tokens, track.num_prompt_tokens)
                stats.num_cached_prompt_tokens += track.num_cached_tokens
            else:
                stats.inter_token_latencies.append(now - track.last_token)
            track.last_token = now
            stats.num_generation_tokens += new_tokens
        if output.finished:
            del self._tracks[output.request_id]
            reasons = [str(c.finish_reason) for c in output.outputs if c.finish_reason]
            scheduled = track.scheduled_at or now
            first = track.first_token or now
            last = track.last_token or now
            longest = max(track.per_choice.values(), default=0)
            stats.finished.append(
                FinishedRequestStats(
                    finish_reason=reasons[-1] if reasons else "abort",
                    e2e_latency=now - track.arrival,
                    queued_time=scheduled - track.arrival,
                    num_prompt_tokens=track.num_prompt_tokens,
                    num_generation_tokens=sum(track.per_choice.values()),
                    prefill_time=first - scheduled,
                    decode_time=last - first,
                    inference_time=last - scheduled,
                    time_per_output_token=(last - first) / (longest - 1) if longest > 1 else 0.0,
                    n=track.n,
                    max_tokens=track.max_tokens,
                    max_choice_tokens=longest,
                    num_preemptions=track.num_preemptions,
                    num_cached_tokens=track.num_cached_tokens,
                )
            )


class StepWatchdog:
    """Notices an engine step that runs longer than `timeout` seconds (liveness point 6).

    Its thread sleeps until a step begins, then wakes at that step's deadline and logs a WARNING
    if the step running then is still that step, or waits on to the deadline of the one that
    is; `stalled` is what /health reads. A step's start wakes it only from idle, so back-to-back
    steps cost no thread wake-up each (on two cores one takes a core from the kernels' threads).
    Idle, it never wakes.
    """

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._cond = threading.Condition()
        self._started: float | None = None
        self._idle = False  # the watcher waits with no deadline: only a notify wakes it
        self._stopping = False
        self._thread = threading.Thread(target=self._watch, name="kvflow-watchdog")
        self._thread.start()

    def begin(self) -> None:
        with self._cond:
            self._started = time.monotonic()
            if self._idle:  # else it wakes at an earlier step's deadline and reads this one
                self._cond.notify()

    def end(self) -> None:
        self._started = None  # no wake-up needed: the watcher checks at its deadline

    @property
    def stalled(self) -> bool:
        started = self._started
        return started is not None and time.monotonic() - started > self.timeout

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout: float) -> threading.Thread:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout)
        return self._thread

    def _watch(self) -> None:
        warned: float | None = None
        with self._cond:
            while not self._stopping:
                started = self._started
                if started is None or started == warned:
                    self._idle = True
                    self._cond.wait()
                    self._idle = False
                    continue
                remaining = started + self.timeout - time.monotonic()
                if remaining > 0:
                    self._cond.wait(remaining)
                    continue
                warned = started
                logger.warning(
                    "engine step has run for over %.1f s (--watchdog-timeout); "
                    "/health answers 503 until it ends",
                    self.timeout,
                )

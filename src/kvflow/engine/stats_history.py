"""The engine's recent history in one-second buckets, for the live page's plots: steps and
step time, tokens, TTFT and inter-token latency.

A `StatLogger`: fed every `IterationStats` of the engine loop (one lock and a few additions
per pass), read by `series()` from any thread. It keeps the last `window_s` seconds.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

from kvflow.core.snapshot import EngineSnapshot
from kvflow.engine.async_stats import IterationStats

FIELDS = (
    "t",  # the second (wall clock, integer)
    "steps",
    "step_s",  # seconds spent in steps
    "prompt_tokens",
    "gen_tokens",
    "ttft_n",
    "ttft_sum",
    "ttft_max",
    "itl_n",
    "itl_sum",
    "itl_max",
    "preemptions",
    "finished",
)


@dataclass(frozen=True)
class LiveSnapshot:
    """What `AsyncEngine.snapshot()` returns: the engine's state and its recent history."""

    engine: EngineSnapshot
    history: list[list[float]]  # rows in FIELDS order
    healthy: bool
    history_fields: tuple[str, ...] = FIELDS


@dataclass(slots=True)
class _Bucket:
    t: int
    steps: int = 0
    step_s: float = 0.0
    prompt_tokens: int = 0
    gen_tokens: int = 0
    ttft_n: int = 0
    ttft_sum: float = 0.0
    ttft_max: float = 0.0
    itl_n: int = 0
    itl_sum: float = 0.0
    itl_max: float = 0.0
    preemptions: int = 0
    finished: int = 0

    def row(self) -> list[float]:
        return [round(getattr(self, name), 6) for name in FIELDS]


class StatsHistory:
    def __init__(self, window_s: int = 600) -> None:
        self.window_s = window_s
        self._buckets: deque[_Bucket] = deque()
        self._lock = threading.Lock()

    def record(self, stats: IterationStats) -> None:
        now = int(time.time())
        with self._lock:
            if not self._buckets or self._buckets[-1].t != now:
                self._buckets.append(_Bucket(now))
                while self._buckets[0].t <= now - self.window_s:
                    self._buckets.popleft()
            b = self._buckets[-1]
            if stats.step_seconds is not None:
                b.steps += 1
                b.step_s += stats.step_seconds
            b.prompt_tokens += stats.num_prompt_tokens
            b.gen_tokens += stats.num_generation_tokens
            b.preemptions += stats.num_preemptions
            b.finished += len(stats.finished)
            for ttft in stats.time_to_first_tokens:
                b.ttft_n += 1
                b.ttft_sum += ttft
                b.ttft_max = max(b.ttft_max, ttft)
            for itl in stats.inter_token_latencies:
                b.itl_n += 1
                b.itl_sum += itl
                b.itl_max = max(b.itl_max, itl)

    def series(self, seconds: int) -> list[list[float]]:
        """Rows (in `FIELDS` order) of the seconds with activity among the last `seconds`,
        oldest first; the seconds between them had none."""
        since = int(time.time()) - seconds
        with self._lock:
            return [b.row() for b in self._buckets if b.t > since]

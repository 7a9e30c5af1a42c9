"""`GET /v1/engine/snapshot` (kvflow's; vLLM has none): the live page's one data source.

The engine is asked at most once per `min_interval_s` server-wide, however many pages poll:
callers within the interval get the cached answer, and callers while one is taken share it.
Each answer is the engine's state (core/snapshot.py) and the last `history_s` seconds of
per-second stats (engine/stats_history.py), as JSON.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

from kvflow.engine.async_llm import AsyncEngine, EngineUnavailableError
from kvflow.engine.stats_history import LiveSnapshot
from kvflow.server.serving import ServingError

MAX_HISTORY_S = 600


class SnapshotCache:
    def __init__(
        self,
        engine: AsyncEngine,
        model_name: str,
        min_interval_s: float = 0.25,
        defaults: dict[str, Any] | None = None,
    ) -> None:
        self.engine = engine
        self.model_name = model_name
        self.min_interval_s = min_interval_s
        self.defaults = dict(defaults or {})
        self._taken_at = -float("inf")
        self._cached: tuple[LiveSnapshot, dict[str, Any]] | None = None
        self._pending: asyncio.Task | None = None
        self.num_taken = 0  # engine snapshots taken (the rate bound's witness)

    async def get(self, history_s: int) -> dict[str, Any]:
        """The JSON body: the latest snapshot no older than `min_interval_s`."""
        history_s = max(0, min(int(history_s), MAX_HISTORY_S))
        live, engine = await self._latest()
        since = time.time() - history_s
        return {
            "object": "kvflow.engine.snapshot",
            "snapshot_seq": self.num_taken,
            "model": self.model_name,
            "healthy": live.healthy,
            "sampling_defaults": self.defaults,
            "engine": engine,
            "history_fields": list(live.history_fields),
            "history": [row for row in live.history if row[0] > since],
        }

    async def _latest(self) -> tuple[LiveSnapshot, dict[str, Any]]:
        if self._cached is not None and time.monotonic() - self._taken_at < self.min_interval_s:
            return self._cached
        if self._pending is None or self._pending.done():
            self._pending = asyncio.ensure_future(self._take())
        return await asyncio.shield(self._pending)

    async def _take(self) -> tuple[LiveSnapshot, dict[str, Any]]:
        try:
            live = await self.engine.snapshot(MAX_HISTORY_S)
        except EngineUnavailableError as exc:
            raise ServingError(str(exc), 503) from exc
        self.num_taken += 1
        self._taken_at = time.monotonic()
        self._cached = (live, dataclasses.asdict(live.engine))
        return self._cached

"""A request's stream of delta outputs on the API side: what `generate` iterates, fed by the
engine loop (a thread, or the engine process's client)."""

from __future__ import annotations

import asyncio
import os
from collections import deque
from collections.abc import Callable

from kvflow.engine.output_merge import merge_delta
from kvflow.outputs import CompletionOutput, RequestOutput

# "0": a stream hands out every delta as it came (the host benchmark's baseline)
MERGE_DELTAS = os.environ.get("KVFLOW_MERGE_DELTAS", "1") != "0"


def terminal_output(req_id: str, n: int, reason: str, error: str | None = None) -> RequestOutput:
    """A finished output with no new tokens, for requests ended outside the engine's step."""
    outs = [CompletionOutput(i, "", [], finish_reason=reason) for i in range(n)]
    metrics = {"error": error} if error else {}
    return RequestOutput(req_id, None, [], outs, True, metrics=metrics)


class RequestStream:
    """The outputs of one request, in order; iteration ends after the terminal output.
    `abort()` (or leaving the iteration early through `AsyncEngine.generate`) frees its blocks.
    Deltas the reader has not taken yet are merged into one (`output_merge`)."""

    def __init__(self, request_id: str, n: int, release: Callable[[str, bool], None]) -> None:
        self.request_id = request_id
        self.n = n
        self._pending: RequestOutput | None = None
        self._backlog: deque[RequestOutput] = deque()  # only with KVFLOW_MERGE_DELTAS=0
        self._ready = asyncio.Event()
        self._release = release
        self.finished = False
        self.terminal_queued = False

    def put(self, output: RequestOutput) -> None:
        if not self.terminal_queued:
            self.terminal_queued = output.finished
            pending = self._pending
            if pending is not None and not MERGE_DELTAS:  # (benchmarks: one delta per read)
                self._backlog.append(pending)
                pending = None
            self._pending = output if pending is None else merge_delta(pending, output)
            self._ready.set()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        if self._backlog:
            output = self._backlog.popleft()
        else:
            if self._pending is None:
                await self._ready.wait()
            output, self._pending = self._pending, None
            self._ready.clear()
        if output.finished:
            self.finished = True
            self._release(self.request_id, False)
        return output

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self._release(self.request_id, True)

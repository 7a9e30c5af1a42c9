"""Requests whose output constraint is still compiling, from admission until their grammar is
ready (the request becomes schedulable) or fails to compile (the request fails alone).

The compile runs on the grammar backend's threads; the engine thread polls here before each
step, and when nothing else can run it waits on the compiles (briefly, so that new requests
and aborts are still taken) instead of stepping an idle engine in a loop.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass

from kvflow.core.messages import EngineCoreOutput
from kvflow.core.request import Request, RequestStatus

logger = logging.getLogger("kvflow.engine")

IDLE_WAIT_S = 0.05  # the longest the engine thread waits on compiles before looking again


@dataclass(slots=True)
class _Pending:
    request: Request
    future: Future
    added_at: float


class PendingGrammars:
    def __init__(self) -> None:
        self._pending: dict[str, _Pending] = {}
        # (request id, seconds from admission to its grammar ready), until taken
        self.compile_times: list[tuple[str, float]] = []
        self.num_failures = 0  # requests failed because their constraint did not compile

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, request: Request, future: Future) -> None:
        """Track a request (already in the scheduler) until `future` (the backend's compile)
        is done; a compiled one is attached at once (a failed one is failed by `poll`)."""
        request.grammar_pending = True
        if future.done() and self._resolve(request, future, time.monotonic()):
            request.grammar_pending = False
            return
        self._pending[request.request_id] = _Pending(request, future, time.monotonic())

    def poll(self, core, block: bool) -> list[EngineCoreOutput]:
        """Resolve finished compiles: ready requests become schedulable, failed ones end with
        an error (their terminal outputs are returned). `block`: wait up to IDLE_WAIT_S for
        one to finish first."""
        if not self._pending:
            return []
        if block:
            futures = [p.future for p in self._pending.values()]
            concurrent.futures.wait(futures, IDLE_WAIT_S, concurrent.futures.FIRST_COMPLETED)
        outputs: list[EngineCoreOutput] = []
        for req_id, pending in list(self._pending.items()):
            req = pending.request
            if core.scheduler.requests.get(req_id) is not req:  # ended (aborted) meanwhile
                del self._pending[req_id]
                continue
            if not pending.future.done():
                continue
            del self._pending[req_id]
            if self._resolve(req, pending.future, pending.added_at):
                req.grammar_pending = False
                continue
            self.num_failures += 1
            error = str(pending.future.exception())
            logger.warning("request %s: %s", req_id, error)
            outputs += core.abort_requests([req_id], RequestStatus.FINISHED_ERROR, error)
        return outputs

    def _resolve(self, request: Request, future: Future, added_at: float) -> bool:
        """Attach the compiled grammar to the request; False when the compile failed."""
        if future.exception() is not None:
            return False
        compiled, _, done_at = future.result()
        request.grammar = compiled
        self.compile_times.append((request.request_id, max(0.0, done_at - added_at)))
        return True

    def take_compile_times(self) -> list[tuple[str, float]]:
        times, self.compile_times = self.compile_times, []
        return times

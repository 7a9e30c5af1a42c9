"""AsyncEngine: an LLMEngine driven by one background thread, one asyncio queue per request.

    event loop (server)                              engine thread
    add_request() ─ _Add ─► inbox ─(Condition)─► engine.add_request / abort / step()
    RequestStream ◄─ loop.call_soon_threadsafe ◄─ delta RequestOutputs
                                                  stat_logger.record(IterationStats)

Only plain data crosses the boundary (commands in, RequestOutputs and stats out), so the loop
can later move into its own process. The thread sleeps on the Condition whenever the engine has
no unfinished request and the inbox is empty: no polling, no periodic wake-ups. Every request
that was admitted gets exactly one terminal output, whatever happens (finish, abort, shutdown,
engine death).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvflow.engine.async_stats import StatLogger, StatsTracker, StepWatchdog
from kvflow.engine.engine_client import EngineClient, EngineDeadError, EngineUnavailableError
from kvflow.engine.engine_core import EngineStats
from kvflow.engine.llm_engine import LLMEngine
from kvflow.engine.request_stream import RequestStream, terminal_output
from kvflow.engine.stats_history import LiveSnapshot, StatsHistory
from kvflow.outputs import RequestOutput
from kvflow.sampling_params import SamplingParams

logger = logging.getLogger("kvflow.engine")


@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None
    arrival: float


@dataclass(frozen=True)
class _Abort:
    request_ids: list[str]


@dataclass(frozen=True)
class _Snapshot:
    future: concurrent.futures.Future


_SNAPSHOT_WAIT_S = 5.0  # a step longer than this (a stall) answers from outside the thread


@dataclass
class _Call:
    method: str
    args: tuple
    future: asyncio.Future


class AsyncEngine(EngineClient):
    def __init__(
        self,
        engine: LLMEngine,
        stat_logger: StatLogger | None = None,
        max_num_queued_reqs: int | None = None,
        watchdog_timeout: float = 0.0,
    ) -> None:
        super().__init__()
        self.engine = engine
        self.stat_logger = stat_logger
        self.max_num_queued_reqs = max_num_queued_reqs
        self.watchdog_timeout = watchdog_timeout
        self._cond = threading.Condition()
        self._inbox: list[_Add | _Abort | _Snapshot | _Call] = []
        self._stopping = False
        self._pending_adds = 0
        self._latest = engine.stats()
        self._tracker = StatsTracker(self._latest)  # engine thread only
        self.history = StatsHistory()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._watchdog: StepWatchdog | None = None

    # ---- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread; call from the event loop that will consume the outputs."""
        self._loop = asyncio.get_running_loop()
        self._released.set()
        self._thread = threading.Thread(target=self._run, name="kvflow-engine", daemon=False)
        self._thread.start()
        if self.watchdog_timeout > 0:
            self._watchdog = StepWatchdog(self.watchdog_timeout)

    async def shutdown(self, timeout: float) -> None:
        """Stop admitting; drain up to `timeout` s (0: none); abort the rest; stop the thread.

        When this returns, every consumer has its terminal output queued (aborts come from the
        engine, which frees their blocks); it does not wait for consumers to read them."""
        self._accepting = False
        if timeout > 0:
            await self._wait_released(timeout)
        await asyncio.to_thread(self.close)  # the thread aborts what still runs, then exits
        for stream in list(self._streams.values()):
            if not stream.terminal_queued:
                stream.put(terminal_output(stream.request_id, stream.n, "abort"))

    def close(self, timeout: float = 30.0) -> None:
        """Stop the engine thread (aborting whatever still runs) and join it. Idempotent;
        needs no event loop."""
        self._accepting = False
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        threads = [self._thread] if self._thread is not None else []
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        if self._watchdog is not None:
            threads.append(self._watchdog.stop(timeout))
        for thread in threads:
            if thread.is_alive():
                logger.error("%s did not stop within %.0f s", thread.name, timeout)
        if not self._thread_alive():
            self.engine.close()

    def threads_alive(self) -> bool:
        watchdog = self._watchdog is not None and self._watchdog.alive
        return self._thread_alive() or watchdog

    # ---- state -------------------------------------------------------------------------------

    @property
    def stalled(self) -> bool:
        return self._watchdog is not None and self._watchdog.stalled

    @property
    def is_healthy(self) -> bool:
        return self.accepting and self._thread_alive() and not self.stalled

    def stats(self) -> EngineStats:
        return self._latest

    async def snapshot(self, history_s: int = 120) -> LiveSnapshot:
        """The scheduler and KV pool as the engine thread sees them between two steps, with
        the last `history_s` seconds of per-second stats. Costs the engine one copy of its
        state (core/snapshot.py); callers bound how often they ask. Raises
        EngineUnavailableError when a stalled step changes the state while it is read."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            posted = self._thread_alive() and not self._stopping
            if posted:
                self._inbox.append(_Snapshot(future))
                self._cond.notify()
        engine = None
        if posted:
            with contextlib.suppress(TimeoutError):
                engine = await asyncio.wait_for(asyncio.wrap_future(future), _SNAPSHOT_WAIT_S)
        if engine is None:  # no thread steps the engine, or a step is stalled: read as is
            try:
                engine = self.engine.snapshot()
            except Exception as exc:  # the stalled step moved on while this read
                raise EngineUnavailableError(f"The engine is busy in a step ({exc}).") from exc
        return LiveSnapshot(engine, self.history.series(history_s), self.is_healthy)

    def _thread_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ---- requests ----------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
    ) -> RequestStream:
        """Validate and queue a request. Raises ValueError, EngineUnavailableError or
        EngineDeadError before anything is queued."""
        params = self._admit(request_id, prompt_token_ids, params)
        with self._cond:  # the engine thread moves _pending_adds and the stats _num_queued reads
            self._check_queue()
            self._pending_adds += 1
            self._inbox.append(
                _Add(request_id, list(prompt_token_ids), params, prompt, time.monotonic())
            )
            self._cond.notify()
        return self._open_stream(request_id, params.n)

    def abort(self, request_id: str) -> None:
        """Abort a request from outside its consumer, which then reads a terminal output
        (finish_reason "abort"). A consumer leaving uses `RequestStream.abort()` instead."""
        stream = self._streams.get(request_id)
        if stream is None:
            return
        if self._thread_alive():
            self._post(_Abort([request_id]))
        else:
            stream.put(terminal_output(request_id, stream.n, "abort"))

    async def call_utility(self, method: str, *args: Any, type: Any = None) -> Any:
        """Run `method(*args)` of the LLMEngine (else of its EngineCore) on the engine thread
        between two steps; its result. The process-backed engine has the same call (`type`
        is for its decoding). Raises RuntimeError naming an unknown method."""
        if not self._thread_alive():
            raise EngineDeadError(self.dead_error or "the engine is not running")
        future = asyncio.get_running_loop().create_future()
        self._post(_Call(method, args, future))
        return await future

    def _release(self, request_id: str, abort: bool) -> None:
        self._streams.pop(request_id, None)
        if abort and self._thread_alive():
            self._post(_Abort([request_id]))
        if not self._streams:
            self._released.set()

    def _accepting_now(self) -> bool:
        return self._accepting and self._loop is not None

    def _num_queued(self, adding: int) -> int:
        """Waiting requests once `adding` more arrive: adds the engine has not seen yet wait
        too, beyond the free running slots (a burst into an idle engine does not queue)."""
        stats, seqs = self._latest, self.engine.config.scheduler.max_num_seqs
        free = 0 if stats.num_waiting else max(seqs - stats.num_running, 0)
        return stats.num_waiting + max(self._pending_adds + adding - free, 0)

    def _post(self, command: _Add | _Abort | _Snapshot | _Call) -> None:
        with self._cond:
            self._inbox.append(command)
            self._cond.notify()

    async def _wait_released(self, timeout: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._released.wait(), timeout)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is not None:
                stream.put(output)

    def _dispatch_dead(self, error: str) -> None:
        for stream in list(self._streams.values()):
            stream.put(terminal_output(stream.request_id, stream.n, "error", error))
        self._dead.set()

    # ---- the engine thread -------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while self._iterate():
                pass
        except Exception as exc:
            self._die(exc)

    def _iterate(self) -> bool:
        with self._cond:
            while not (self._inbox or self._stopping or self.engine.has_unfinished_requests()):
                self._cond.wait()
            commands, self._inbox = self._inbox, []
            stopping = self._stopping
        outputs = self._apply(commands)
        step_start = None
        if stopping:
            outputs += self.engine.abort_request(self._tracker.live())
        elif self.engine.has_unfinished_requests():
            step_start = time.monotonic()
            if self._watchdog is not None:
                self._watchdog.begin()
            try:
                outputs += self.engine.step()
            finally:
                if self._watchdog is not None:
                    self._watchdog.end()
        num_adds = sum(isinstance(c, _Add) for c in commands)
        self._publish(outputs, step_start, num_adds)
        return not stopping

    def _apply(self, commands: list[_Add | _Abort | _Snapshot | _Call]) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        for cmd in commands:
            if isinstance(cmd, _Snapshot):
                _resolve(cmd.future, self.engine.snapshot)
                continue
            if isinstance(cmd, _Call):
                self._call(cmd)
                continue
            if isinstance(cmd, _Abort):
                ids = [i for i in cmd.request_ids if i in self._tracker]
                outputs += self.engine.abort_request(ids)
                continue
            n_prompt = len(cmd.prompt_token_ids)
            self._tracker.arrive(
                cmd.request_id, cmd.params.n, n_prompt, cmd.arrival, cmd.params.max_tokens
            )
            try:
                self.engine.add_request(
                    cmd.request_id, cmd.prompt_token_ids, cmd.params, prompt=cmd.prompt
                )
            except ValueError as exc:
                outputs.append(terminal_output(cmd.request_id, cmd.params.n, "error", str(exc)))
        return outputs

    def _call(self, cmd: _Call) -> None:
        fn = None
        if not cmd.method.startswith("_"):
            fn = getattr(self.engine, cmd.method, None) or getattr(
                self.engine.core, cmd.method, None
            )
        try:
            if not callable(fn):
                raise RuntimeError(f"no engine method {cmd.method!r}")
            result, error = fn(*cmd.args), None
        except Exception as exc:
            result, error = (
                None,
                exc
                if isinstance(exc, RuntimeError)
                else RuntimeError(f"{type(exc).__name__}: {exc}"),
            )
        self._call_loop(_settle, cmd.future, result, error)

    def _publish(self, outputs: list[RequestOutput], step_start: float | None, adds: int) -> None:
        stats = self._tracker.iteration(
            self.engine.stats(), outputs, step_start, self.engine.core.last_step_tokens
        )
        stats.grammar_compile_times = [
            seconds for _, seconds in self.engine.pending_grammars.take_compile_times()
        ]
        with self._cond:
            self._latest = stats.engine
            self._pending_adds -= adds
        self.history.record(stats)
        if self.stat_logger is not None:
            try:
                self.stat_logger.record(stats)
            except Exception:
                logger.exception("recording engine stats failed")
        if outputs:
            self._call_loop(self._dispatch, outputs)

    def _die(self, exc: Exception) -> None:
        """Liveness under failure: fail every request with an error output, mark the engine
        dead (health 503) and tell the loop, which exits the server non-zero."""
        error = f"The engine failed: {type(exc).__name__}: {exc}"
        logger.exception("engine loop failed; failing %d request(s)", len(self._tracker.live()))
        self.dead_error = error
        self._accepting = False
        with self._cond:
            pending = [c for c in self._inbox if isinstance(c, _Add)]
            for cmd in self._inbox:
                if isinstance(cmd, _Snapshot):
                    _resolve(cmd.future, self.engine.snapshot)
            calls = [c for c in self._inbox if isinstance(c, _Call)]
            self._inbox = []
        for call in calls:
            self._call_loop(_settle, call.future, None, EngineDeadError(error))
        outputs: list[RequestOutput] = []
        try:
            outputs = self.engine.fail_all(error)
        except Exception:
            logger.exception("failing the requests cleanly failed too")
        ended = {o.request_id for o in outputs if o.finished}
        for request_id, n in self._tracker.live_choices().items():
            if request_id not in ended:
                outputs.append(terminal_output(request_id, n, "error", error))
        outputs += [terminal_output(c.request_id, c.params.n, "error", error) for c in pending]
        try:
            self._publish(outputs, None, len(pending))
        except Exception:
            logger.exception("publishing the failure failed")
        self._call_loop(self._dispatch_dead, error)

    def _call_loop(self, fn: Callable, *args: object) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed since the check
                loop.call_soon_threadsafe(fn, *args)


def _resolve(future: concurrent.futures.Future, fn: Callable) -> None:
    """Answer a snapshot request, unless its caller stopped waiting (cancelled: skipped)."""
    if not future.set_running_or_notify_cancel():
        return
    try:
        result = fn()
    except Exception as exc:
        future.set_exception(exc)
        return
    future.set_result(result)


def _settle(future: asyncio.Future, result: Any, error: Exception | None) -> None:
    if not future.done():
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)

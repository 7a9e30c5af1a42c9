"""ProcessEngine: the AsyncEngine interface over an engine core in its own process.

    event loop (API server)                                    engine core process
    add_request ─ LLMEngine.add_request ─ RemoteCore ─ Add ──► EngineCoreProc: step loop
    RequestStream ◄─ OutputProcessor (detokenize) ◄── Step ◄── outputs + EngineStats
    /health: the process is alive and has reported within --watchdog-timeout while busy

Tokenization, validation, detokenization, stop strings, n > 1 fan-in and the metrics' per-request
timings stay here; the process only schedules and runs the model. A stop string found here
ends its request in the core with an Abort (status stopped); the tokens the core made meanwhile
are dropped by the OutputProcessor, as with async scheduling.

Liveness across the boundary: every admitted request gets exactly one terminal output. The
engine process exiting unexpectedly (a crash, SIGKILL, the OOM killer) is engine death, seen
through a pidfd on the event loop: every request fails, `/health` turns 503, the server exits 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import time
from typing import Any

import zmq
import zmq.asyncio

from kvflow.core.request import Request, RequestStatus
from kvflow.core.snapshot import EngineSnapshot
from kvflow.engine import core_wire as wire
from kvflow.engine.async_stats import StatLogger, StatsTracker
from kvflow.engine.core_launch import EngineProcess, stop_process
from kvflow.engine.engine_client import EngineClient, EngineDeadError
from kvflow.engine.engine_core import EngineStats
from kvflow.engine.llm_engine import LLMEngine
from kvflow.engine.request_stream import RequestStream, terminal_output
from kvflow.engine.stats_history import LiveSnapshot, StatsHistory
from kvflow.outputs import RequestOutput
from kvflow.sampling_params import SamplingParams

logger = logging.getLogger("kvflow.engine")

_BYE_TIMEOUT_S = 10.0  # how long a Shutdown may take before the process is killed


class RemoteCore:
    """What LLMEngine calls on its core, sent to the engine process instead (never blocks).
    Ending requests answers later, through the Step messages, not as a return value."""

    def __init__(self, initial: EngineStats | None = None) -> None:
        self.send: Any = None  # set by ProcessEngine.start: bytes -> None
        self.codec = wire.Codec()
        self.latest = initial
        self.adds_sent = 0

    def add_request(self, request: Request) -> None:
        new = wire.NewRequest(
            request.request_id,
            request.prompt_token_ids,
            request.max_tokens,
            request.sampling_params,
            request.eos_token_id,
            sorted(request.stop_token_ids),
            request.min_tokens,
            request.ignore_eos,
            request.skip_reading_prefix_cache,
            request.arrival_time,
        )
        self.adds_sent += 1
        self.send(wire.Add([new]))

    def abort_requests(self, req_ids, status=RequestStatus.FINISHED_ABORTED, error=None) -> list:
        if req_ids:
            self.send(wire.Abort(list(req_ids), int(status), error))
        return []

    def has_unfinished_requests(self) -> bool:
        return False  # the API side never steps

    def stats(self) -> EngineStats:
        return self.latest


class ProcessEngine(EngineClient):
    """AsyncEngine's public interface (add_request, generate, abort, shutdown, close, stats,
    is_healthy, accepting, stalled, wait_dead, call_utility) over an EngineProcess."""

    def __init__(
        self,
        engine: LLMEngine,
        process: EngineProcess,
        stat_logger: StatLogger | None = None,
        max_num_queued_reqs: int | None = None,
        watchdog_timeout: float = 0.0,
        identity: bytes = b"api-0",
        owns_process: bool = True,
    ) -> None:
        super().__init__()
        self.engine = engine
        self.process = process
        self.remote: RemoteCore = engine.core  # type: ignore[assignment]
        self.stat_logger = stat_logger
        self.history = StatsHistory()  # per-second stats for the live view
        self.max_num_queued_reqs = max_num_queued_reqs
        self.watchdog_timeout = watchdog_timeout
        self.identity = identity
        self.owns_process = owns_process
        self.codec = wire.Codec()
        self._latest = _zero_stats()
        self.remote.latest = self._latest
        self._tracker = StatsTracker(self._latest)
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._started = False
        self._exited = False
        self._busy = False
        self._heard = time.monotonic()
        self._adds_applied = 0
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._receiver: asyncio.Task | None = None
        self._pidfd: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._bye = asyncio.Event()

    # ---- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Connect and start receiving; call from the event loop that consumes the outputs."""
        self._loop = asyncio.get_running_loop()
        self._released.set()
        self._ctx = zmq.asyncio.Context()
        sock = self._ctx.socket(zmq.DEALER)
        for opt in (zmq.SNDHWM, zmq.RCVHWM):
            sock.setsockopt(opt, 0)
        sock.setsockopt(zmq.IDENTITY, self.identity)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.connect(self.process.address)
        self._sock = sock
        self.remote.send = self._send
        self._send(wire.Hello())  # this socket now owns the identity (ROUTER_HANDOVER)
        self._receiver = self._loop.create_task(self._receive())
        self._started = True
        try:
            self._pidfd = os.pidfd_open(self.process.pid)
            self._loop.add_reader(self._pidfd, self._on_process_exit)
        except (AttributeError, OSError):  # no pidfd: the engine is gone already (or not Linux)
            self._loop.call_soon(self._on_process_exit)

    async def shutdown(self, timeout: float) -> None:
        """Stop admitting; drain up to `timeout` s (0: none); abort the rest. The owner of the
        process then stops it (Shutdown; Bye comes after the aborts' outputs). When this
        returns every consumer has its terminal output queued; call `close()` to reap."""
        self._accepting = False
        if timeout > 0:
            await self._wait(self._released, timeout)
        if self.dead_error is None and not self._exited and self._started:
            if self.owns_process:
                self._send(wire.Shutdown())
                await self._wait(self._bye, _BYE_TIMEOUT_S)
            else:
                self.engine.abort_request(self.request_ids())
                await self._wait(self._released, _BYE_TIMEOUT_S)
        for stream in list(self._streams.values()):
            if not stream.terminal_queued:
                stream.put(terminal_output(stream.request_id, stream.n, "abort"))
        # The process exits on its own after Bye, while the server finishes its answers;
        # `close()` (the server's last step) reaps it.

    def close(self, timeout: float = 10.0) -> None:
        """Stop the engine process if this client owns it (killed if it does not exit within
        `timeout` s) and close the socket. Idempotent; needs no event loop."""
        self._accepting = False
        proc = self.process.proc
        if self.owns_process and proc is not None:
            ending = self._bye.is_set() or self.dead_error is not None  # exiting on its own
            code = stop_process(proc, timeout if ending else 0.0)
            self._exited = True
            if code not in (0, None) and self.dead_error is None:
                logger.info("engine process exited with status %s", code)
        if self._loop is not None and self._receiver is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._receiver.cancel)
        if self._pidfd is not None:
            with contextlib.suppress(Exception):
                if self._loop is not None and not self._loop.is_closed():
                    self._loop.remove_reader(self._pidfd)
            with contextlib.suppress(OSError):
                os.close(self._pidfd)
            self._pidfd = None
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    def threads_alive(self) -> bool:
        proc = self.process.proc
        return self.owns_process and proc is not None and proc.poll() is None

    # ---- state -------------------------------------------------------------------------------

    @property
    def stalled(self) -> bool:
        """Busy, and the engine's latest Step was sent longer than --watchdog-timeout ago
        (it starts its next step right after): a step that runs too long, or a stopped
        process. The engine process logs the WARNING (its StepWatchdog)."""
        return (
            self.watchdog_timeout > 0
            and self._busy
            and time.monotonic() - self._heard > self.watchdog_timeout
        )

    @property
    def is_healthy(self) -> bool:
        return self.accepting and self._started and not self._exited and not self.stalled

    def stats(self) -> EngineStats:
        return self._latest

    # ---- requests ----------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
    ) -> RequestStream:
        """Validate and send a request. Raises ValueError, EngineUnavailableError or
        EngineDeadError before anything is sent."""
        params = self._admit(request_id, prompt_token_ids, params)
        self._check_queue()
        if not self._busy:
            self._busy, self._heard = True, time.monotonic()
        self.engine.add_request(request_id, prompt_token_ids, params, prompt)
        self._tracker.arrive(
            request_id, params.n, len(prompt_token_ids), time.monotonic(), params.max_tokens
        )
        return self._open_stream(request_id, params.n)

    def abort(self, request_id: str) -> None:
        """Abort a request from outside its consumer, which then reads a terminal output."""
        stream = self._streams.get(request_id)
        if stream is None:
            return
        if self._live():
            self.engine.abort_request([request_id])
        else:
            stream.put(terminal_output(request_id, stream.n, "abort"))

    async def snapshot(self, history_s: int = 120) -> LiveSnapshot:
        """The engine process's scheduler and KV pool between two steps (a utility call), with
        the last `history_s` seconds of per-second stats kept on this side."""
        engine = await self.call_utility("snapshot", type=EngineSnapshot)
        return LiveSnapshot(engine, self.history.series(history_s), self.is_healthy)

    async def call_utility(self, method: str, *args: Any, type: Any = Any) -> Any:
        """Run `method(*args)` on the engine side between two steps (a method of the engine
        loop, the LLMEngine or the EngineCore); its plain-data result, decoded as `type`.
        Raises RuntimeError with the engine side's error."""
        if not self._live():
            raise EngineDeadError(self.dead_error or "the engine process has exited")
        call_id = next(self._call_ids)
        future = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        self._send(wire.Utility(call_id, method, list(args)))
        data = await future
        return wire.decode_result(data, type)

    def _release(self, request_id: str, abort: bool) -> None:
        self._streams.pop(request_id, None)
        if abort and self._live():
            self.engine.abort_request([request_id])
        if not self._streams:
            self._released.set()

    def _accepting_now(self) -> bool:
        return self._accepting and self._started

    def _num_queued(self, adding: int) -> int:
        """As AsyncEngine's: waiting requests once `adding` more arrive, counting the adds the
        engine has not taken yet beyond its free running slots."""
        stats, seqs = self._latest, self.engine.config.scheduler.max_num_seqs
        free = 0 if stats.num_waiting else max(seqs - stats.num_running, 0)
        pending = self.remote.adds_sent - self._adds_applied
        return stats.num_waiting + max(pending + adding - free, 0)

    def _live(self) -> bool:
        return self._started and not self._exited and self.dead_error is None

    def _send(self, msg: object) -> None:
        if self._sock is not None:
            self._sock.send(self.codec.encode(msg), copy=False)

    @staticmethod
    async def _wait(event: asyncio.Event, timeout: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), timeout)

    # ---- what comes up -------------------------------------------------------------------------

    async def _receive(self) -> None:
        sock = self._sock
        while sock is not None:
            data = await sock.recv(copy=True)
            try:
                self._on_message(self.codec.decode_up(data))
            except Exception as exc:  # a bug here must not leave requests hanging
                logger.exception("handling an engine message failed")
                self._die(f"The engine client failed: {type(exc).__name__}: {exc}")
                return

    def _on_message(self, msg: wire.Up) -> None:
        if isinstance(msg, wire.Step):
            self._on_step(msg)
        elif isinstance(msg, wire.UtilityResult):
            future = self._calls.pop(msg.call_id, None)
            if future is not None and not future.done():
                if msg.error is None:
                    future.set_result(msg.result)
                else:
                    future.set_exception(RuntimeError(msg.error))
        elif isinstance(msg, wire.Dead):
            self._die(msg.error)
        elif isinstance(msg, wire.Bye):
            self._bye.set()

    def _on_step(self, msg: wire.Step) -> None:
        self._heard = max(msg.sent_at, self._heard)
        self._latest = self.remote.latest = msg.stats
        self._busy = msg.busy or self.remote.adds_sent > msg.adds_applied
        self._adds_applied = msg.adds_applied
        outputs: list[RequestOutput] = []
        if msg.outputs:
            outputs, stopped = self.engine.output_processor.process(msg.outputs)
            if stopped:
                self.remote.abort_requests(stopped, RequestStatus.FINISHED_STOPPED)
        stats = self._tracker.iteration(msg.stats, outputs, msg.step_start, msg.step_tokens)
        stats.grammar_compile_times = msg.grammar_compile_times
        self.history.record(stats)
        if self.stat_logger is not None:
            try:
                self.stat_logger.record(stats)
            except Exception:
                logger.exception("recording engine stats failed")
        streams = self._streams
        for output in outputs:
            stream = streams.get(output.request_id)
            if stream is not None:
                stream.put(output)

    def _on_process_exit(self) -> None:
        """The engine process ended. After a Shutdown (Bye) that is the plan; otherwise it is
        engine death. Messages it sent before exiting are taken first."""
        if self._pidfd is not None and self._loop is not None:
            self._loop.remove_reader(self._pidfd)
        if self._exited:
            return
        self._exited = True
        proc = self.process.proc
        code = proc.poll() if proc is not None else None
        if self._bye.is_set() or self.dead_error is not None:
            return
        self._loop.create_task(self._die_after_drain(code))

    async def _die_after_drain(self, code: int | None) -> None:
        await asyncio.sleep(0.2)  # what the process sent before it exited arrives first
        if self.dead_error is None and not self._bye.is_set():
            why = "was killed by a signal" if code is not None and code < 0 else "exited"
            self._die(f"The engine process {why} (status {code}); no request can run.")

    def _die(self, error: str) -> None:
        """Engine death: every request a terminal error, /health 503, the server exits 1."""
        if self.dead_error is not None:
            return
        logger.error("%s; failing %d request(s)", error, len(self._streams))
        self.dead_error = error
        self._accepting = False
        for stream in list(self._streams.values()):
            stream.put(terminal_output(stream.request_id, stream.n, "error", error))
        for future in self._calls.values():
            if not future.done():
                future.set_exception(EngineDeadError(error))
        self._calls.clear()
        self._dead.set()


def _zero_stats() -> EngineStats:
    return EngineStats(0, 0, 0, 0.0, 0, 0, 0, 0, 0)

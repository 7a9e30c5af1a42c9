"""How the front end (`AsyncEngine`) reaches its engine loop (`core_loop.CoreLoop`), in either
placement:

    ThreadCore    the loop on a thread of this process; messages pass as objects (a
                  Condition-guarded inbox down, `call_soon_threadsafe` up)
    ProcessCore   the loop in the engine core process (`core_proc`); msgspec over ZeroMQ, the
                  process watched through a pidfd

Both take the same commands (the `core_wire` Down messages: `add_request`, `abort_requests`,
`utility`, `shutdown`) and give back the same Up messages, in order, from `recv()`. The end of
the loop always arrives as a message: Bye after a Shutdown, Dead when it failed, and for an
engine process that exits without either (a crash, SIGKILL, the OOM killer) a Dead made here
once everything the process sent before it died has been read.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from kvflow.core.request import RequestStatus
from kvflow.engine import core_wire as wire
from kvflow.engine.core_launch import EngineProcess, stop_process
from kvflow.engine.core_loop import CoreLoop
from kvflow.engine.engine_core import EngineCore, EngineCoreRequest

logger = logging.getLogger("kvflow.engine")

WIRE_CHECK_ENV = "KVFLOW_WIRE_CHECK"
_DISCONNECT_WAIT_S = 5.0  # after the process exits, how long its socket may take to close


class _Commands:
    """The commands down, as a subclass's `_send` delivers them; ending requests is answered
    later, by the Step messages, never by a return value."""

    owns_engine = True  # the client that may send Shutdown (else it aborts its own requests)

    def __init__(self) -> None:
        self.adds_sent = 0  # EngineCoreRequests sent, in all

    def add_request(self, new: EngineCoreRequest) -> None:
        self.adds_sent += 1
        self._send(wire.Add([new]))

    def abort_requests(self, req_ids, status=RequestStatus.FINISHED_ABORTED, error=None) -> list:
        if req_ids:
            self._send(wire.Abort(list(req_ids), int(status), error))
        return []

    def utility(self, call_id: int, method: str, args: list[Any]) -> None:
        self._send(wire.Utility(call_id, method, args))

    def shutdown(self) -> None:
        """Abort everything, answer Bye, end the loop."""
        self._send(wire.Shutdown())

    def _send(self, msg: wire.Down) -> None:
        raise NotImplementedError


class ThreadCore(_Commands):
    """The loop on a thread of this process, over `core` (which it closes when it ends).
    With $KVFLOW_WIRE_CHECK=1 (the test suite sets it) every message down and up goes through
    the engine process's msgspec encoding, so a field that cannot cross the wire fails in this
    placement too, not in the other alone."""

    def __init__(self, core: EngineCore, info: wire.EngineInfo, watchdog_timeout: float = 0.0):
        super().__init__()
        self.core = core
        self._codec = wire.Codec() if os.environ.get(WIRE_CHECK_ENV) == "1" else None
        self.pid = os.getpid()
        self._cond = threading.Condition()
        self._inbox: list[tuple[bytes, wire.Down]] = []
        self._up: asyncio.Queue = asyncio.Queue()
        self._loop: asyncio.AbstractEventLoop | None = None
        loop = CoreLoop(core, self, info, watchdog_timeout)
        self._thread = threading.Thread(target=loop.run, name="kvflow-engine", daemon=False)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._send(wire.Hello())
        self._thread.start()

    async def recv(self) -> wire.Up:
        return await self._up.get()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def close(self, timeout: float = 30.0) -> None:
        """Shut the loop down if it still runs, join it (bounded) and close the core.
        Idempotent; needs no event loop."""
        if self._thread.is_alive():
            self.shutdown()
            if self._thread is not threading.current_thread():
                self._thread.join(timeout)
            if self._thread.is_alive():
                logger.error("the engine thread did not stop within %.0f s", timeout)
                return
        self.core.close()

    # ---- the loop's Transport --------------------------------------------------------------------

    def wait(self) -> None:
        with self._cond:
            while not self._inbox:
                self._cond.wait()

    def take(self) -> list[tuple[bytes, wire.Down]]:
        with self._cond:
            taken, self._inbox = self._inbox, []
        return taken

    def send(self, identity: bytes, msg: wire.Up) -> None:
        if self._codec is not None:
            msg = self._codec.decode_up(self._codec.encode(msg))
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the event loop closed since the check
                loop.call_soon_threadsafe(self._up.put_nowait, msg)

    def _send(self, msg: wire.Down) -> None:
        if self._codec is not None:
            msg = self._codec.decode_down(self._codec.encode(msg))
        with self._cond:
            self._inbox.append((b"", msg))
            self._cond.notify()


class ProcessCore(_Commands):
    """The loop in the engine core process; this client's socket says Hello as `identity`.
    With `owns_process` (one API server) it stops the process when it closes; else the
    supervisor of several API servers does."""

    def __init__(self, process: EngineProcess, identity: bytes, owns_process: bool) -> None:
        super().__init__()
        self.process = process
        self.pid = process.pid
        self.identity = identity
        self.owns_engine = owns_process
        self.codec = wire.Codec()
        self._up: asyncio.Queue = asyncio.Queue()
        self._ended = False  # Bye or Dead has come up
        self._exited = False
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task] = []
        self._disconnected = asyncio.Event()
        self._pidfd: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._ctx = zmq.asyncio.Context()
        sock = self._ctx.socket(zmq.DEALER)
        for opt in (zmq.SNDHWM, zmq.RCVHWM):
            sock.setsockopt(opt, 0)
        sock.setsockopt(zmq.IDENTITY, self.identity)
        sock.setsockopt(zmq.LINGER, 1000)
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sock.connect(self.process.address)
        self._sock = sock
        self._send(wire.Hello())  # this socket now owns the identity (ROUTER_HANDOVER)
        self._tasks = [loop.create_task(self._read()), loop.create_task(self._watch(monitor))]
        try:
            self._pidfd = os.pidfd_open(self.pid)
            loop.add_reader(self._pidfd, self._on_exit)
        except (AttributeError, OSError):  # no pidfd: the engine is gone already (or not Linux)
            loop.call_soon(self._on_exit)

    async def recv(self) -> wire.Up:
        return await self._up.get()

    def alive(self) -> bool:
        """The engine process runs (as far as this process can tell, for one it did not
        start)."""
        proc = self.process.proc
        return proc.poll() is None if proc is not None else not self._exited

    def close(self, timeout: float = 10.0) -> None:
        """Stop the engine process if this client owns it (killed if it does not exit within
        `timeout` s after its Bye or death, at once otherwise) and close the socket.
        Idempotent; needs no event loop."""
        proc = self.process.proc
        if self.owns_engine and proc is not None:
            code = stop_process(proc, timeout if self._ended else 0.0)
            if code not in (0, None):
                logger.info("engine process exited with status %s", code)
        loop = self._loop
        live = loop is not None and not loop.is_closed()
        for task in self._tasks:
            if live:
                loop.call_soon_threadsafe(task.cancel)
        if self._pidfd is not None:
            with contextlib.suppress(Exception):
                if live:
                    loop.remove_reader(self._pidfd)
            with contextlib.suppress(OSError):
                os.close(self._pidfd)
            self._pidfd = None
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    def _send(self, msg: wire.Down) -> None:
        if self._sock is not None and not self._exited:
            self._sock.send(self.codec.encode(msg), copy=False)

    async def _read(self) -> None:
        while self._sock is not None:
            self._deliver(self.codec.decode_up(await self._sock.recv(copy=True)))

    def _deliver(self, msg: wire.Up) -> None:
        self._ended = self._ended or isinstance(msg, wire.Bye | wire.Dead)
        self._up.put_nowait(msg)

    async def _watch(self, monitor: zmq.asyncio.Socket) -> None:
        try:
            while True:
                event = parse_monitor_message(await monitor.recv_multipart())
                if event["event"] == zmq.EVENT_DISCONNECTED:
                    self._disconnected.set()
        finally:
            monitor.close(linger=0)

    def _on_exit(self) -> None:
        """The engine process ended: read everything it sent before (its socket's disconnect
        comes after the last message), then, unless it said Bye or Dead, that is its death."""
        if self._pidfd is not None and self._loop is not None:
            self._loop.remove_reader(self._pidfd)
        if not self._exited:
            self._exited = True
            self._tasks.append(self._loop.create_task(self._drain_then_end()))

    async def _drain_then_end(self) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._disconnected.wait(), _DISCONNECT_WAIT_S)
        self._tasks[0].cancel()  # the reader: what is left is taken here, without waiting
        sock = self._sock
        while sock is not None and not self._ended:
            try:
                data = await sock.recv(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                break
            self._deliver(self.codec.decode_up(data))
        if not self._ended:
            proc = self.process.proc
            code = proc.poll() if proc is not None else None
            why = "was killed by a signal" if code is not None and code < 0 else "exited"
            self._deliver(
                wire.Dead(f"The engine process {why} (status {code}); no request can run.")
            )

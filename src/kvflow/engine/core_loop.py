"""The engine loop: commands in, one EngineCore step, outputs out. The one loop body of both
placements: on a thread of the server's process (`core_client.ThreadCore`) or in the engine
process (`core_proc`), behind a Transport that moves `core_wire` messages.

    clients ─ Add / Abort / Utility / Shutdown ─► CoreLoop ─► EngineCore.step()
    clients ◄─ Step (outputs + counters) / UtilityResult / Dead / Bye ─┘

The loop waits on its transport only when the core has no unfinished request (an idle engine
sleeps); with work it takes whatever commands have arrived without waiting, steps, and sends
each client one Step per pass. Sends never block: the loop never waits on the HTTP side.
Every admitted request gets one terminal output: on Shutdown every request is aborted before
Bye, and an exception in the loop fails every request before Dead.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import asdict, dataclass
from typing import Protocol

from kvflow.core.messages import EngineCoreOutput
from kvflow.core.request import RequestStatus
from kvflow.engine import core_wire as wire
from kvflow.engine.async_stats import StepWatchdog
from kvflow.engine.engine_core import EngineCore

logger = logging.getLogger("kvflow.engine")


class Transport(Protocol):
    def wait(self) -> None:
        """Block until a command has arrived."""
        ...

    def take(self) -> list[tuple[bytes, wire.Down]]:
        """The commands that have arrived, with their clients' identities; never blocks."""
        ...

    def send(self, identity: bytes, msg: wire.Up) -> None:
        """Queue `msg` for a client; never blocks."""
        ...


@dataclass
class LoopStats:
    """Where the loop's wall time goes, in seconds, since it started serving."""

    passes: int = 0
    steps: int = 0
    step_s: float = 0.0  # inside EngineCore.step (schedule, model, update)
    apply_s: float = 0.0  # taking and applying commands
    send_s: float = 0.0  # sending outputs
    idle_s: float = 0.0  # waiting for a command with no unfinished request
    max_send_s: float = 0.0

    def line(self) -> str:
        items = asdict(self).items()
        return " ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in items)


class CoreLoop:
    """One owner (client) per request; every client gets a Step after every pass."""

    def __init__(
        self,
        core: EngineCore,
        transport: Transport,
        info: wire.EngineInfo,
        watchdog_timeout: float = 0.0,
    ) -> None:
        self.core = core
        self.transport = transport
        self.info = info
        self.clients: dict[bytes, int] = {}  # identity -> EngineCoreRequests taken
        self.owner: dict[str, bytes] = {}  # core request id -> its client's identity
        self.timing = LoopStats()
        self._stopping = False
        self._watchdog = StepWatchdog(watchdog_timeout) if watchdog_timeout > 0 else None

    def loop_stats(self) -> LoopStats:
        """Where the loop's time went so far (a utility call's answer)."""
        return self.timing

    def run(self) -> int:
        """Serve until Shutdown (returns 0) or an exception (fails everything, returns 1)."""
        try:
            while self._iterate():
                pass
            return 0
        except Exception as exc:
            self._die(exc)
            return 1
        finally:
            if self._watchdog is not None:
                self._watchdog.stop(5.0)
            logger.info("engine loop: %s", self.timing.line())

    def _iterate(self) -> bool:
        st, core = self.timing, self.core
        st.passes += 1
        t0 = time.monotonic()
        if not core.has_unfinished_requests():
            self.transport.wait()
        t1 = time.monotonic()
        outputs: list[EngineCoreOutput] = []
        for identity, msg in self.transport.take():
            self._apply(identity, msg, outputs)
        t2 = time.monotonic()
        st.idle_s += t1 - t0
        st.apply_s += t2 - t1
        if self._stopping:
            outputs += core.abort_requests(list(core.scheduler.requests))
            self._publish(outputs, None)
            for identity in self.clients:
                self.transport.send(identity, wire.Bye())
            return False
        step_start = None
        if core.has_unfinished_requests():
            step_start = time.monotonic()
            if self._watchdog is not None:
                self._watchdog.begin()
            try:
                outputs += core.step()
            finally:
                if self._watchdog is not None:
                    self._watchdog.end()
            st.steps += 1
            st.step_s += time.monotonic() - step_start
        t3 = time.monotonic()
        self._publish(outputs, step_start)
        sent = time.monotonic() - t3
        st.send_s += sent
        st.max_send_s = max(st.max_send_s, sent)
        return True

    def _apply(self, identity: bytes, msg: wire.Down, outputs: list[EngineCoreOutput]) -> None:
        if isinstance(msg, wire.Add):
            for new in msg.requests:
                self.owner[new.request_id] = identity
                try:
                    self.core.add_request(new)
                except ValueError as exc:
                    outputs.append(_error_output(new.request_id, str(exc)))
            self.clients[identity] = self.clients.get(identity, 0) + len(msg.requests)
        elif isinstance(msg, wire.Abort):
            status = RequestStatus(msg.status)
            outputs += self.core.abort_requests(msg.request_ids, status, msg.error)
        elif isinstance(msg, wire.Hello):
            self.clients.setdefault(identity, 0)
            self.transport.send(identity, wire.Ready(self.info, os.getpid()))
        elif isinstance(msg, wire.Utility):
            self.transport.send(identity, self._call(msg))
        elif isinstance(msg, wire.Shutdown):
            self._stopping = True

    def _call(self, msg: wire.Utility) -> wire.UtilityResult:
        """A method of this loop, else of the EngineCore, by name; it runs between two
        steps. Its result crosses as msgspec bytes in both placements."""
        for target in (self, self.core):
            fn = getattr(target, msg.method, None) if not msg.method.startswith("_") else None
            if callable(fn):
                break
        else:
            return wire.UtilityResult(msg.call_id, b"", f"no engine method {msg.method!r}")
        try:
            return wire.UtilityResult(msg.call_id, wire.encode_result(fn(*msg.args)))
        except Exception as exc:
            return wire.UtilityResult(msg.call_id, b"", f"{type(exc).__name__}: {exc}")

    def _publish(self, outputs: list[EngineCoreOutput], step_start: float | None) -> None:
        """Every client gets one Step per pass: its outputs and the engine's counters."""
        per_client: dict[bytes, list[EngineCoreOutput]] = {c: [] for c in self.clients}
        compiles: dict[bytes, list[float]] = {c: [] for c in self.clients}
        owner = self.owner
        for req_id, seconds in self.core.pending_grammars.take_compile_times():
            if owner.get(req_id) in compiles:
                compiles[owner[req_id]].append(seconds)
        for out in outputs:
            identity = owner.pop(out.req_id, None) if out.finish_reason else owner.get(out.req_id)
            if identity in per_client:
                per_client[identity].append(out)
        stats = self.core.stats()
        busy = self.core.has_unfinished_requests()
        tokens = self.core.last_step_tokens
        now = time.monotonic()
        for identity, outs in per_client.items():
            step = wire.Step(
                outs, stats, step_start, tokens, busy, self.clients[identity], now,
                compiles[identity],
            )  # fmt: skip
            self.transport.send(identity, step)

    def _die(self, exc: Exception) -> None:
        error = f"The engine failed: {type(exc).__name__}: {exc}"
        live = list(self.core.scheduler.requests)
        logger.exception("engine loop failed; failing %d request(s)", len(live))
        outputs: list[EngineCoreOutput] = []
        try:
            outputs = self.core.abort_requests(live, RequestStatus.FINISHED_ERROR, error)
        except Exception:
            logger.exception("failing the requests cleanly failed too")
        ended = {o.req_id for o in outputs}
        outputs += [_error_output(r, error) for r in self.owner if r not in ended]
        try:
            self._publish(outputs, None)
            for identity in self.clients:
                self.transport.send(identity, wire.Dead(error))
        except Exception:
            logger.exception("telling the clients failed")


def _error_output(req_id: str, error: str) -> EngineCoreOutput:
    return EngineCoreOutput(req_id, [], finish_reason="error", error=error)

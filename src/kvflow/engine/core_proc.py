"""The engine core process: the engine assembled here, its loop (`core_loop.CoreLoop`) serving one
or more API server processes over a ZeroMQ ROUTER socket (`core_wire` messages).

    python -m kvflow.engine.core_proc ADDRESS SPEC_JSON      (started by `core_launch`)

Signals: during start-up SIGTERM/SIGINT end the process at once (`startup`: what is
half-written is removed); once serving it ignores them, since its parent orchestrates shutdown
(a drain must not lose its engine to a signal sent to the whole process group). The parent's
death kills it (PR_SET_PDEATHSIG), so it is never orphaned.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys

import msgspec
import zmq

from kvflow.engine import core_wire as wire
from kvflow.engine.core_loop import CoreLoop
from kvflow.engine.llm_engine import EngineArgs
from kvflow.engine.startup import configure_logging, install_start_up_signals, load_core

_PR_SET_PDEATHSIG = 1


class LaunchSpec(msgspec.Struct):
    """What the parent passes on the command line (JSON)."""

    engine_args: EngineArgs
    parent_pid: int
    watchdog_timeout: float = 0.0


class ZmqTransport:
    """The loop's Transport over a ROUTER socket: one DEALER per API server process, one frame
    per message. Sends never block (no high-water mark)."""

    def __init__(self, sock: zmq.Socket) -> None:
        self.sock = sock
        self.codec = wire.Codec()

    def wait(self) -> None:
        self.sock.poll()

    def take(self) -> list[tuple[bytes, wire.Down]]:
        taken = []
        while True:
            try:
                identity, data = self.sock.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return taken
            taken.append((identity, self.codec.decode_down(data)))

    def send(self, identity: bytes, msg: wire.Up) -> None:
        self.sock.send_multipart([identity, self.codec.encode(msg)], copy=False)


def set_parent_death_signal() -> None:
    """The kernel kills this process when its parent dies (Linux; elsewhere a no-op)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def serve(address: str, spec: LaunchSpec) -> int:
    """Load, bind, serve; the exit status (0 after Shutdown, 1 after engine death, 2 for a
    configuration that cannot serve)."""
    install_start_up_signals()
    try:
        core, info, _ = load_core(spec.engine_args)
    except ValueError as exc:
        print(f"kvflow serve: error: {exc}", file=sys.stderr, flush=True)
        return 2
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    ctx = zmq.Context(1)
    sock = ctx.socket(zmq.ROUTER)
    for opt in (zmq.SNDHWM, zmq.RCVHWM):
        sock.setsockopt(opt, 0)
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a client's identity moves to its newest socket
    sock.bind(address)
    try:
        return CoreLoop(core, ZmqTransport(sock), info, spec.watchdog_timeout).run()
    finally:
        sock.close(linger=5000)  # the last outputs, Dead or Bye reach the clients first
        ctx.term()
        core.close()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    address, spec = argv[0], msgspec.json.decode(argv[1], type=LaunchSpec)
    set_parent_death_signal()
    if os.getppid() != spec.parent_pid:  # the parent died before the line above
        return 1
    configure_logging()
    code = serve(address, spec)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip the interpreter's teardown of torch (seconds on a small CPU)


if __name__ == "__main__":
    sys.exit(main())

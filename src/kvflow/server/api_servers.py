"""`kvflow serve --api-server-count N` (N > 1): a supervisor process, one engine core process
and N API server processes on one port.

    supervisor ─┬─ engine core process (ROUTER)      loads the model, steps EngineCore
                ├─ API server 0 (DEALER "api-0")  ┐  accept() on the supervisor's listening
                └─ API server N-1                 ┘  socket, inherited (kernel load-balances)

The supervisor is handed the bound port (`listen.bind_or_exit`), starts the engine, then the
API servers (each gets the socket's fd, which its uvicorn listens on, and the engine's address),
and owns every death: a SIGTERM/SIGINT goes to each API server (which drains or aborts its
own requests as `--shutdown-timeout` says, answers every client and exits), then the engine
gets Shutdown; a second signal is forwarded too (they exit at once). An API server or the
engine exiting on its own ends everything, status 1. Every child dies with the supervisor
(PR_SET_PDEATHSIG). Each API server keeps its own request metrics; the engine's gauges are
the same in all.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time

import zmq

from kvflow.engine import core_launch, startup
from kvflow.engine import core_wire as wire
from kvflow.engine.core_launch import EngineStartError
from kvflow.server.args import ARGS_ENV, engine_args_from

logger = logging.getLogger("kvflow.server")

_EXIT_BOUND_S = 30.0


def run_supervisor(args: argparse.Namespace, listener: socket.socket) -> int:
    """Serve on `listener` (bound, not listening: each API server's uvicorn listens on it)."""
    startup.configure_logging()
    startup.install_start_up_signals()
    try:
        engine, _ = core_launch.launch_engine(engine_args_from(args), args.watchdog_timeout)
    except ValueError as exc:
        print(f"kvflow serve: error: {exc}", file=sys.stderr, flush=True)
        return 2
    except EngineStartError as exc:
        return exc.code if exc.code > 0 else 1
    servers = [
        _spawn_api_server(args, i, engine.address, listener.fileno())
        for i in range(args.api_server_count)
    ]
    logger.info(
        "%d API server processes (pids %s) on %s:%d over the engine process (pid %d)",
        len(servers),
        ", ".join(str(p.pid) for p in servers),
        args.host,
        args.port,
        engine.pid,
    )
    code = Supervisor(engine, servers).run()
    # Every child is reaped: skip the interpreter's teardown of torch (seconds on a busy host).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _spawn_api_server(
    args: argparse.Namespace, index: int, address: str, fd: int
) -> subprocess.Popen:
    flags = {**vars(args), "engine_address": address, "api_server_index": index}
    flags.update(listen_fd=fd, api_server_count=1)
    env = {**os.environ, ARGS_ENV: json.dumps(flags, default=str)}
    cmd = [sys.executable, "-m", "kvflow.server.api_server"]
    # its own process group: a terminal's Ctrl-C reaches the supervisor, which forwards it once
    return subprocess.Popen(cmd, env=env, pass_fds=(fd,), process_group=0)


class Supervisor:
    def __init__(self, engine: core_launch.EngineProcess, servers: list[subprocess.Popen]):
        self.engine = engine
        self.servers = servers
        self.signals = 0

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        proc = self.engine.proc
        while True:
            if proc is not None and proc.poll() is not None:
                logger.error("the engine process exited (status %s)", proc.returncode)
                self._end_servers(signal.SIGTERM, 5.0)
                return 1
            codes = [p.poll() for p in self.servers]
            if all(c is not None for c in codes):
                status = self._stop_engine()
                return 0 if self.signals and not any(codes) and status == 0 else 1
            if any(c is not None for c in codes) and not self.signals:
                logger.error("an API server exited on its own (statuses %s); stopping", codes)
                self._end_servers(signal.SIGTERM, _EXIT_BOUND_S)
                self._stop_engine()
                return 1
            time.sleep(0.05)

    def _on_signal(self, signum: int, frame: object) -> None:
        self.signals += 1
        logger.info("signal %d: passing it to the API servers", signum)
        for p in self.servers:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)

    def _end_servers(self, sig: int, timeout: float) -> None:
        for p in self.servers:
            if p.poll() is None:
                p.send_signal(sig)
        deadline = time.monotonic() + timeout
        for p in self.servers:
            try:
                p.wait(max(deadline - time.monotonic(), 0.0))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def _stop_engine(self) -> int:
        """Shutdown to the engine (every API server is gone: nothing is live); bounded."""
        proc = self.engine.proc
        if proc is None or proc.poll() is not None:
            return 0 if proc is None else proc.returncode
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, b"supervisor")
        sock.connect(self.engine.address)
        sock.send(wire.Codec().encode(wire.Shutdown()))
        status = core_launch.stop_process(proc, 10.0)
        sock.close(linger=0)
        return status

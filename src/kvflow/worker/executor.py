"""MultiprocExecutor: the EngineCore's runner when the model runs on N tensor-parallel ranks,
one process each (`python -m kvflow.worker.tp_worker`, a fresh interpreter: nothing of the
caller's `__main__` runs again, unlike multiprocessing's spawn), supervised from the process
that starts them. Each rank has a socket pair wrapped as a multiprocessing Connection, and a
pidfd that turns readable when it exits, so one `wait` covers both.

All ranks are children, rank 0 included: the process holding the EngineCore (the server's, or
an engine process) never blocks inside a collective, so a rank's death is seen at once as its
process sentinel firing, and that process holds no torch.distributed state of its own. The cost
is one pipe hop per step to rank 0 and back (measured in benchmarks/RESULTS.md); rank 0 passes
the step on to the others with one broadcast over the gloo CPU group.

The contract (each point a test in tests/liveness/test_live_tp.py):
  - a rank that fails or dies at start-up ends start-up with that rank's error (RankError);
  - a rank that dies or fails during a step fails that step with RankError: to the engine,
    engine death (every request fails, /health 503, exit 1);
  - a hung rank hangs the step: the engine's watchdog reports it;
  - `shutdown` (also at exit, through atexit) stops every rank within STOP_GRACE_S, then kills
    what is left; ranks whose parent dies exit on their own (tp_worker.watch_parent).
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import weakref
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from pathlib import Path

from kvflow.core.messages import ModelRunnerOutput, SchedulerOutput
from kvflow.structured.wire import GrammarSender
from kvflow.worker.tp_worker import RankLoaded, RankSpec

logger = logging.getLogger("kvflow.engine")

STOP_GRACE_S = 1.0  # a stopped rank's time to exit before it is killed
_LIVE: weakref.WeakSet = weakref.WeakSet()  # executors with ranks to stop (mp and Ray)


class RankError(RuntimeError):
    """A tensor-parallel rank failed or died; the message names it and says how."""


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for the ranks' rendezvous."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RankProcess:
    """One rank's process, its Connection and its pidfd (`sentinel`)."""

    def __init__(self, spec: RankSpec, rank: int) -> None:
        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        # the kvflow this process runs, also when it came from sys.path rather than the
        # environment (benchmarks/gpu_check.py inserts src/)
        package_root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
        if spec.device == "cpu" and "OMP_NUM_THREADS" not in env:
            per_rank = spec.threads or max(1, (os.cpu_count() or 1) // spec.world_size)
            env["OMP_NUM_THREADS"] = str(per_rank)  # before torch starts its OpenMP pool
        command = [sys.executable, "-m", "kvflow.worker.tp_worker", "--rank", str(rank)]
        command += ["--fd", str(theirs.fileno()), "--parent", str(os.getpid())]
        # its own session: a terminal's Ctrl-C (SIGINT to the foreground process group) goes
        # to the server, which drains, not to the ranks, which it still needs
        self.popen = subprocess.Popen(
            command, pass_fds=[theirs.fileno()], env=env, start_new_session=True
        )
        theirs.close()
        self.pid = self.popen.pid
        self.sentinel = os.pidfd_open(self.pid)
        self.conn = Connection(ours.detach())
        self.conn.send(spec)

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()

    def join(self, timeout: float) -> None:
        try:
            self.popen.wait(max(timeout, 0))
        except subprocess.TimeoutExpired:
            pass

    def kill(self) -> None:
        self.popen.kill()

    def close(self) -> None:
        self.conn.close()
        os.close(self.sentinel)


def describe_exit(code: int | None) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        return f"was killed by signal {-code} ({signal.Signals(-code).name})"
    return f"exited with status {code}"


def stop_all() -> None:
    """Stop the ranks of every live executor (at process exit)."""
    for executor in list(_LIVE):
        executor.shutdown()


def kill_all() -> None:
    """SIGKILL every rank of every live executor now, without waiting: a signal handler's
    way (a signal during start-up); the kernel ends them, their parent's exit reaps them."""
    for executor in list(_LIVE):
        for proc in getattr(executor, "procs", []):  # (a Ray cluster dies with its starter)
            if proc.exitcode is None:
                proc.kill()


atexit.register(stop_all)


class MultiprocExecutor:
    """A Runner over `world_size` rank processes; `loaded` is each rank's RankLoaded, and
    `num_blocks` the pool's block count (the minimum over the ranks). Raises RankError when a
    rank fails to start."""

    def __init__(self, spec: RankSpec, start_timeout_s: float = 900.0) -> None:
        self.procs: list[RankProcess] = []
        self._closed = False
        self._finalizer = weakref.finalize(self, stop_ranks, self.procs)
        _LIVE.add(self)
        try:
            for rank in range(spec.world_size):
                self.procs.append(RankProcess(spec, rank))
            self.conns = [p.conn for p in self.procs]
            self.loaded = self._await_ready(start_timeout_s)
            self.num_blocks = min(r.num_blocks for r in self.loaded)
        except BaseException:
            self.shutdown()
            raise
        self.step_send_s = 0.0  # time spent pickling and sending steps (benchmarks)
        self._grammars = GrammarSender()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def _await_ready(self, timeout_s: float) -> list[RankLoaded]:
        ready_ranks: dict[int, RankLoaded] = {}
        deadline = time.monotonic() + timeout_s
        while len(ready_ranks) < len(self.procs):
            waiting = [c for r, c in enumerate(self.conns) if r not in ready_ranks]
            left = deadline - time.monotonic()
            ready = wait(waiting + [p.sentinel for p in self.procs], timeout=max(left, 0))
            if not ready:
                raise RankError(f"tensor-parallel ranks not ready after {timeout_s:.0f} s")
            for rank, conn in enumerate(self.conns):
                if conn in ready:
                    message = self._recv(rank)
                    if message[0] == "error":
                        raise RankError(
                            f"tensor-parallel rank {rank} failed at start-up:\n{message[1]}"
                        )
                    ready_ranks[rank] = RankLoaded(**message[1])
            self._raise_if_dead("at start-up")
        return [ready_ranks[rank] for rank in range(len(self.procs))]

    def _recv(self, rank: int) -> tuple:
        try:
            return self.conns[rank].recv()
        except (EOFError, OSError):
            self.procs[rank].join(STOP_GRACE_S)
            raise RankError(self._death(rank, "")) from None

    def _death(self, rank: int, when: str) -> str:
        proc = self.procs[rank]
        where = f" {when}" if when else ""
        return f"tensor-parallel rank {rank} (pid {proc.pid}){where} {describe_exit(proc.exitcode)}"

    def _raise_if_dead(self, when: str) -> None:
        for rank, proc in enumerate(self.procs):
            if proc.exitcode is not None:
                error = ""
                if self.conns[rank].poll():  # its last words, if it sent them
                    message = self._recv(rank)
                    error = f":\n{message[1]}" if message[0] == "error" else ""
                raise RankError(self._death(rank, when) + error)

    def launch(self, scheduler_output: SchedulerOutput) -> Callable[[], ModelRunnerOutput]:
        """Send the step to rank 0; the returned call waits for its output. Raises RankError
        when a rank is dead or fails the step."""
        if self._closed:
            raise RankError("the tensor-parallel ranks are stopped")
        start = time.perf_counter()
        try:
            self.conns[0].send(("step", self._grammars.encode(scheduler_output)))
        except OSError:
            self._raise_if_dead("before a step")
            raise
        self.step_send_s += time.perf_counter() - start
        return self._wait_output

    def _wait_output(self) -> ModelRunnerOutput:
        ready = wait([self.conns[0]] + [p.sentinel for p in self.procs])
        if self.conns[0] in ready:
            message = self._recv(0)
            if message[0] == "output":
                return message[1]
            raise RankError(f"tensor-parallel rank 0 failed a step:\n{message[1]}")
        for proc in self.procs:
            proc.join(0.05)  # a sentinel fired: reap it
        self._raise_if_dead("during a step")
        raise RankError("a tensor-parallel rank ended during a step")

    def timers(self) -> dict[str, float]:
        """Rank 0's seconds in each kind of collective since the last call (benchmarks)."""
        self.conns[0].send(("timers",))
        return self._recv(0)[1]

    def shutdown(self) -> None:
        """Stop every rank (`stop_ranks`). Idempotent; also runs when the executor is
        collected and at interpreter exit."""
        self._closed = True
        self._finalizer()
        _LIVE.discard(self)


def stop_ranks(procs: list[RankProcess]) -> None:
    """("stop",) to rank 0, which ends the others; whatever has not exited STOP_GRACE_S later
    is killed; every rank process is reaped."""
    try:
        procs[0].conn.send(("stop",))
    except (OSError, IndexError):
        pass
    deadline = time.monotonic() + STOP_GRACE_S
    for proc in procs:
        proc.join(deadline - time.monotonic())
    for proc in procs:
        if proc.exitcode is None:
            logger.warning("tensor-parallel rank (pid %d) did not stop: killing it", proc.pid)
            proc.kill()
            proc.join(5)
        proc.close()

"""Where the server's engine loop runs, and starting the engine core process (synchronous: before
the server's event loop exists).

    engine_process_enabled(device)   the placement: $KVFLOW_ENGINE_PROCESS, else the engine
                                     process on CUDA (as vLLM) and a thread on the CPU
    launch_engine(args)              spawn `python -m kvflow.engine.core_proc`, wait for Ready
    load_frontend_tokenizer(info)    the engine's tokenizer, for an API server (no torch)

The wait polls in short slices so that a start-up signal's handler runs at once in this
process (`startup.exit_during_start_up` forwards it to the engine process, which removes what
it had half-written, then exits).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq

from kvflow import tokenizer_files
from kvflow.engine import core_wire as wire
from kvflow.engine import startup
from kvflow.engine.core_proc import LaunchSpec, set_parent_death_signal
from kvflow.engine.llm_engine import EngineArgs

# "1": the server's engine loop runs in the engine core process; "0": on a thread of the API
# server's process; unset: the engine process on CUDA, a thread on the CPU (README, "Processes")
ENV = "KVFLOW_ENGINE_PROCESS"


def engine_process_enabled(device: str) -> bool:
    """The placement for `--device` (cpu, cuda[:N] or auto)."""
    value = os.environ.get(ENV, "").strip()
    if value:
        return value != "0"
    return device.startswith("cuda") or (device == "auto" and cuda_present())


def cuda_present() -> bool:
    """An NVIDIA card is visible to this process, read from the driver's /proc entries (this
    process does not import torch to find out)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return False
    try:
        return any(os.scandir("/proc/driver/nvidia/gpus"))
    except OSError:
        return False


class EngineStartError(RuntimeError):
    """The engine process exited before it was ready; `code` is its exit status."""

    def __init__(self, code: int) -> None:
        super().__init__(f"the engine process exited with status {code} during start-up")
        self.code = code


@dataclass
class EngineProcess:
    """A running engine core process (None `proc`: started by another process)."""

    address: str
    ready: wire.Ready
    proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int:
        return self.ready.pid


def new_address() -> str:
    return f"ipc://{tempfile.gettempdir()}/kvflow-engine-{uuid.uuid4().hex[:12]}"


def spawn_engine(args: EngineArgs, watchdog_timeout: float, address: str) -> subprocess.Popen:
    """Start the engine process (it loads the model, then binds `address`). Call it from the
    main thread: the child dies with the thread that forked it (PR_SET_PDEATHSIG)."""
    spec = LaunchSpec(args, os.getpid(), watchdog_timeout)
    cmd = [sys.executable, "-m", "kvflow.engine.core_proc", address, msgspec.json.encode(spec)]
    proc = subprocess.Popen([*cmd[:-1], cmd[-1].decode()])
    startup.starting(proc)
    return proc


def wait_ready(address: str, identity: bytes, proc: subprocess.Popen | None) -> wire.Ready:
    """Say Hello as `identity` and wait for Ready. Raises EngineStartError if `proc` exits."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, identity)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    codec = wire.Codec()
    try:
        sock.send(codec.encode(wire.Hello()))
        while True:
            if sock.poll(100):
                msg = codec.decode_up(sock.recv())
                if isinstance(msg, wire.Ready):
                    return msg
            if proc is not None and proc.poll() is not None:
                raise EngineStartError(proc.returncode)
    finally:
        sock.close()


def launch_engine(
    args: EngineArgs, watchdog_timeout: float = 0.0, meanwhile: Callable[[], Any] | None = None
) -> tuple[EngineProcess, Any]:
    """Start the engine process, run `meanwhile()` here while it loads (the API side's own
    start-up: its tokenizer), wait for Ready. Returns the process and what `meanwhile` gave.
    On any error the engine process is killed before it propagates."""
    address = new_address()
    proc = spawn_engine(args, watchdog_timeout, address)
    try:
        prepared = meanwhile() if meanwhile is not None else None
        ready = wait_ready(address, b"api-0", proc)
    except BaseException:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        raise
    finally:
        startup.starting(None)
    return EngineProcess(address, ready, proc), prepared


def stop_process(proc: subprocess.Popen, timeout: float) -> int:
    """SIGKILL after `timeout` s; returns the exit status (reaped: no zombie)."""
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def load_frontend_tokenizer(info: wire.EngineInfo, chat_template: str | None) -> Any:
    """The tokenizer of the engine `info` describes, for a front end in another process: the
    class the engine loaded, from the model's files, without torch (`tokenizer_files`)."""
    tokenizer = tokenizer_files.load_as(info.model_path, info.tokenizer_class)
    tokenizer_files.load_chat_template(tokenizer, chat_template)
    return tokenizer


def die_with_parent() -> None:
    """For a process the supervisor started: die with it; exit now if it is already gone."""
    parent = os.getppid()
    set_parent_death_signal()
    if os.getppid() != parent or parent == 1:
        os._exit(1)

"""Start-up, the same in the API server process and the engine core process: the log format, the
engine loaded on a thread that then exits, the start-up's objects frozen, and SIGTERM/SIGINT
ending the start-up at once (forwarded to a child still starting, what is half-written
removed).
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from types import FrameType
from typing import Any

from kvflow.paths import remove_scratch

logger = logging.getLogger("kvflow.engine")

_starting: list[subprocess.Popen] = []  # child processes still starting (the engine process)


def configure_logging() -> None:
    """The log format of every kvflow process but a rank's (`tp_worker`): INFO and up, on
    stderr. First thing at start-up: the start-up's own lines need it."""
    logging.basicConfig(
        level=logging.INFO,
        format="%(levelname)s %(asctime)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def load_core(args: Any) -> tuple[Any, Any, Any]:
    """(EngineCore, EngineInfo, tokenizer) for `args` (EngineArgs), assembled on a thread that
    then exits, its objects frozen (`freeze_loaded`). libgomp keeps an OpenMP thread pool per
    thread that ran a parallel region; with the loading thread's left beside the engine loop's
    it counts more threads than cores and has them sleep at once between regions instead of
    spinning, so each of a step's ~200 regions waits for a wake-up (benchmarks/RESULTS.md:
    decode steps 1.5x slower served than offline). A thread's pool goes when the thread ends."""
    from kvflow.engine.assembly import assemble  # torch lives below this line

    with ThreadPoolExecutor(1, thread_name_prefix="kvflow-load") as pool:
        loaded = pool.submit(assemble, args).result()
    freeze_loaded()
    return loaded


def freeze_loaded() -> None:
    """Freeze what the start-up left live (the ~300k objects of a model load, or the front
    end's tokenizer and imports): it lives as long as the process, so a full collection (which
    Python runs now and then as requests come and go) scans only what serving made instead of
    stalling every thread for it. Once, when the start-up's objects are all made."""
    gc.collect()
    gc.freeze()


def install_start_up_signals() -> None:
    """Until the server takes the signals over, SIGTERM/SIGINT end the start-up at once
    (`exit_during_start_up`). From the main thread only."""
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, exit_during_start_up)


def exit_during_start_up(signum: int, frame: FrameType | None) -> None:
    """Forward the signal to a child still starting and wait (bounded) for it to clean up;
    SIGKILL tensor-parallel ranks started so far; remove what is half-written
    (`paths.remove_scratch`: a GGUF conversion's temporary directory, a kernel build's
    output); exit with 128 + signal. It raises nothing: an exception raised here can land in
    Python code that C++ called (torch's imports run such code), and escaping through C++ it
    aborts the process."""
    for proc in list(_starting):
        if proc.poll() is None:
            proc.send_signal(signum)
            try:
                proc.wait(8.0)
            except subprocess.TimeoutExpired:
                proc.kill()
    executor = sys.modules.get("kvflow.worker.executor")  # loaded only if ranks were started
    if executor is not None:
        executor.kill_all()
    remove_scratch()
    logger.info("signal %d during start-up: exiting", signum)
    logging.shutdown()
    os._exit(128 + signum)


def starting(proc: subprocess.Popen | None) -> None:
    """`proc` is starting (None: none is any more)."""
    _starting.clear()
    if proc is not None:
        _starting.append(proc)

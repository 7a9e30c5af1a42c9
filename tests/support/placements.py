"""The server's engine front end (AsyncEngine) over a real engine in either placement, for tests
that drive it without HTTP: its loop on a thread of this process, or in an engine core process.
The liveness and server suites pick the placement of their real servers the same way
(`$KVFLOW_ENGINE_PROCESS`, `support.live`)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from kvflow.engine.assembly import assemble
from kvflow.engine.async_llm import AsyncEngine
from kvflow.engine.core_client import ProcessCore, ThreadCore
from kvflow.engine.core_launch import launch_engine, load_frontend_tokenizer
from kvflow.engine.llm_engine import EngineArgs, LLMEngine

PLACEMENTS = ("thread", "process")


@contextmanager
def engine_loops(placement: str, args: EngineArgs) -> Iterator[Any]:
    """What `front_end` takes for `placement`, for a module's tests to share: the engine
    process started (and killed at the end), or for a thread the arguments each test's own
    engine is built from."""
    if placement == "thread":
        yield args
        return
    process, _ = launch_engine(args)
    try:
        yield process
    finally:
        if process.proc is not None and process.proc.poll() is None:
            process.proc.kill()
            process.proc.wait()


def front_end(placement: str, shared: Any, owner: bool = False, **kwargs: Any) -> AsyncEngine:
    """A new AsyncEngine (kwargs: its stat_logger, queue limit, watchdog): over an engine of
    its own on a thread, or a client of the shared engine process that stops it only as its
    `owner`."""
    if placement == "thread":
        core, info, tokenizer = assemble(shared)
        return AsyncEngine(LLMEngine(info, tokenizer, ThreadCore(core, info)), **kwargs)
    info = shared.ready.info
    client = ProcessCore(shared, b"api-0", owns_process=owner)
    tokenizer = load_frontend_tokenizer(info, None)
    return AsyncEngine(LLMEngine(info, tokenizer, client, parse_constraints=False), **kwargs)

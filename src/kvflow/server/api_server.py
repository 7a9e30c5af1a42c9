"""The `kvflow serve` process: FastAPI routes over the serving layer, the app factory, signal
handling and `run_server(args)`.

Shutdown (SIGTERM/SIGINT): stop admitting (503, /health 503) while still listening, drain for
`--shutdown-timeout` seconds (0: none), abort the rest so every client gets a terminal answer,
then let uvicorn close the listener and exit 0. A second signal exits at once. Engine death
fails every request, turns /health to 503, and exits 1.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from types import FrameType
from typing import Any

import uvicorn
from fastapi import FastAPI

from kvflow import tokenizer_files
from kvflow.engine import core_launch, startup
from kvflow.engine.async_llm import AsyncEngine
from kvflow.engine.core_client import ProcessCore, ThreadCore
from kvflow.engine.core_launch import EngineProcess, EngineStartError, die_with_parent
from kvflow.engine.llm_engine import LLMEngine
from kvflow.server.args import (
    add_serve_arguments,
    args_from_env,
    check_serve_args,
    engine_args_from,
)
from kvflow.server.engine_view import SnapshotCache
from kvflow.server.frontend import LoggingStatLogger, StatLoggers, install_frontend
from kvflow.server.generation_defaults import default_sampling_params, describe, parse_override
from kvflow.server.http import ApiKeyMiddleware, install_error_handlers, install_openapi
from kvflow.server.listen import bind_or_exit
from kvflow.server.metrics import ServerMetrics
from kvflow.server.page import install_page
from kvflow.server.request_fields import UnknownFields
from kvflow.server.routes import ServerContext, router
from kvflow.server.serving_chat import ChatServing
from kvflow.server.serving_completion import CompletionServing
from kvflow.server.serving_messages import MessagesServing
from kvflow.server.tool_choice import ToolConfig

logger = logging.getLogger("kvflow.server")

# After the engine has given every request its terminal output, how long uvicorn may take to
# finish writing responses (a client that stops reading cannot hold the process longer).
_GRACEFUL_S = 5


class ShutdownController:
    """Runs the graceful shutdown once, on the event loop, then tells uvicorn to exit."""

    def __init__(self, engine: AsyncEngine, timeout: float) -> None:
        self.engine = engine
        self.timeout = timeout
        self.exit_code = 0
        self.server: uvicorn.Server | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._signals = 0

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def on_signal(self, sig: int) -> None:
        """Runs in the main thread (a signal handler): never blocks."""
        self._signals += 1
        if self._signals > 1:
            logger.warning("second signal %d: exiting now", sig)
            os._exit(128 + sig)
        logger.info("signal %d: shutting down (--shutdown-timeout %g s)", sig, self.timeout)
        if self._loop is None or self._loop.is_closed():
            if self.server is not None:
                self.server.should_exit = True
            return
        self._loop.call_soon_threadsafe(self.begin, 0)

    def begin(self, exit_code: int) -> None:
        if self._task is not None:
            return
        self.exit_code = exit_code
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        try:
            await self.engine.shutdown(self.timeout)
        except Exception:
            logger.exception("engine shutdown failed")
            self.exit_code = self.exit_code or 1
        finally:
            if self.engine.dead_error is not None:
                self.exit_code = 1
            if self.server is not None:
                self.server.should_exit = True

    async def watch_engine(self) -> None:
        error = await self.engine.wait_dead()
        logger.error("the engine is dead (%s); exiting with status 1", error)
        self.begin(1)


class _Server(uvicorn.Server):
    def __init__(
        self,
        config: uvicorn.Config,
        controller: ShutdownController,
        on_listening: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(config)
        self.controller = controller
        self.on_listening = on_listening

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started and self.on_listening is not None:
            self.on_listening()  # before the first connection is served

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not uvicorn's: it would close the listener at once and wait forever for in-flight
        # requests, and re-raise the signal at exit (status -15 instead of 0).
        self.controller.on_signal(sig)


def _metrics(engine: LLMEngine, args: argparse.Namespace, name: str) -> ServerMetrics:
    return ServerMetrics(
        name,
        engine.config,
        args.gpu_memory_utilization,
        getattr(args, "num_blocks", None),
        getattr(args, "kv_cache_memory", None),
    )


def _stat_loggers(metrics: ServerMetrics, args: argparse.Namespace) -> StatLoggers:
    """/metrics, and the periodic log line unless --disable-log-stats."""
    log_stats = None if getattr(args, "disable_log_stats", True) else LoggingStatLogger()
    return StatLoggers(metrics, log_stats)


def _server_context(
    async_engine: AsyncEngine,
    engine: LLMEngine,
    args: argparse.Namespace,
    names: list[str],
    metrics: ServerMetrics,
) -> ServerContext:
    """The serving objects the routes call, with the model's sampling defaults."""
    root = args.model or args.model_tag or engine.model_name
    defaults = default_sampling_params(
        getattr(args, "generation_config", "vllm"),
        args.model or args.model_tag,
        parse_override(getattr(args, "override_generation_config", None)),
    )
    logger.info(describe(defaults, engine.max_model_len))
    common = dict(
        served_names=list(names),
        model_root=root,
        request_timeout=args.request_timeout,
        log_requests=args.enable_log_requests and not args.disable_log_requests,
        trust_request_chat_template=args.trust_request_chat_template,
        max_log_len=getattr(args, "max_log_len", None),
        sampling_defaults=defaults,
        unknown_fields=UnknownFields(getattr(args, "strict_request_fields", False)),
    )
    chat = ChatServing(async_engine, **common, tool_config=tool_config_from(args))
    return ServerContext(
        engine=async_engine,
        completion=CompletionServing(async_engine, **common),
        chat=chat,
        messages=MessagesServing(chat),
        metrics=metrics,
        snapshots=SnapshotCache(async_engine, names[0], defaults=defaults),
    )


def build_app(
    engine: LLMEngine, args: argparse.Namespace, api_key: str | None = None
) -> tuple[FastAPI, ShutdownController]:
    """The app over `engine`, the front end's LLMEngine whose core is a core client
    (`_start_engine`); the engine starts and stops with the app's lifespan. `api_key`
    defaults to `args.api_key`."""
    api_key = api_key if api_key is not None else getattr(args, "api_key", None)
    names = args.served_model_name or [engine.model_name]
    metrics = _metrics(engine, args, names[0])
    async_engine = AsyncEngine(
        engine,
        stat_logger=_stat_loggers(metrics, args),
        max_num_queued_reqs=args.max_num_queued_reqs,
        watchdog_timeout=args.watchdog_timeout,
    )
    controller = ShutdownController(async_engine, args.shutdown_timeout)
    ctx = _server_context(async_engine, engine, args, names, metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        controller.attach(asyncio.get_running_loop())
        watcher = asyncio.create_task(controller.watch_engine())
        try:
            yield
        finally:
            watcher.cancel()
            await async_engine.shutdown(0)

    from kvflow import __version__

    app = FastAPI(
        title="kvflow",
        version=__version__,
        lifespan=lifespan,
        root_path=getattr(args, "root_path", None) or "",
    )
    app.state.ctx = ctx
    app.include_router(router)
    install_error_handlers(app)
    install_openapi(app)
    if not getattr(args, "disable_web_ui", False):
        install_page(app)
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    install_frontend(app, args)
    return app, controller


def tool_config_from(args: argparse.Namespace) -> ToolConfig:
    return ToolConfig(
        enable_auto_tool_choice=getattr(args, "enable_auto_tool_choice", False),
        tool_call_parser=getattr(args, "tool_call_parser", None),
        reasoning_parser=getattr(args, "reasoning_parser", None),
        chat_template_given=getattr(args, "chat_template", None) is not None,
    )


def _print_engine(engine: LLMEngine) -> None:
    cache = engine.config.cache
    print(
        f"kvflow: KV cache {cache.num_blocks} blocks x {cache.block_size} tokens "
        f"(block 0 reserved) = {cache.servable_tokens} servable tokens; "
        f"max_model_len {engine.max_model_len}; dtype {engine.dtype_name}; device {engine.device}",
        flush=True,
    )


def _print_serving(engine: LLMEngine, args: argparse.Namespace) -> None:
    """The start-up lines that say where to connect: printed once the socket listens."""
    scheme = "https" if args.ssl_certfile else "http"
    url = f"{scheme}://{args.host}:{args.port}{args.root_path or ''}"
    names = ", ".join(args.served_model_name or [engine.model_name])
    print(f"kvflow: serving {names} at {url} (OpenAI API: {url}/v1)", flush=True)
    if not getattr(args, "disable_web_ui", False):
        print(f"kvflow: chat and live engine view: {url}/", flush=True)


def api_identity(index: int) -> bytes:
    return f"api-{index}".encode()


def _start_engine(args: argparse.Namespace) -> LLMEngine:
    """This process's front end over the engine loop: on a thread here, or in the engine
    process (started here, or by the --api-server-count supervisor); `core_launch` says
    which."""
    if args.engine_address is not None:
        die_with_parent()
        identity = api_identity(args.api_server_index)
        ready = core_launch.wait_ready(args.engine_address, identity, None)
        process = EngineProcess(args.engine_address, ready)
        client: Any = ProcessCore(process, identity, owns_process=False)
    elif core_launch.engine_process_enabled(args.device):
        # The engine process resolves the model (a GGUF's directory is written there, and a
        # start-up signal forwarded to it removes a half-written one); this one, which loads
        # neither torch nor xgrammar (README, "Processes"), takes the tokenizer the engine names
        # once it is ready.
        process, _ = core_launch.launch_engine(
            engine_args_from(args), args.watchdog_timeout, tokenizer_files.import_tokenizers
        )
        client = ProcessCore(process, api_identity(0), owns_process=True)
    else:
        core, info, tokenizer = startup.load_core(engine_args_from(args))
        return LLMEngine(info, tokenizer, ThreadCore(core, info, args.watchdog_timeout))
    info = process.ready.info
    tokenizer = core_launch.load_frontend_tokenizer(info, args.chat_template)
    startup.freeze_loaded()
    return LLMEngine(info, tokenizer, client, parse_constraints=False)


def _build_server(engine: LLMEngine, args: argparse.Namespace) -> _Server:
    _print_engine(engine)
    api_key = args.api_key or os.environ.get("VLLM_API_KEY") or os.environ.get("KVFLOW_API_KEY")
    app, controller = build_app(engine, args, api_key)
    config = uvicorn.Config(
        app,
        host=args.host,  # the socket's (`run_server` hands it to uvicorn): for uvicorn's logs
        port=args.port,
        log_level=args.uvicorn_log_level,
        access_log=not args.disable_uvicorn_access_log,
        timeout_keep_alive=5,
        timeout_graceful_shutdown=_GRACEFUL_S,
        root_path=args.root_path or "",
        ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile,
        ssl_ca_certs=args.ssl_ca_certs,
    )
    server = _Server(config, controller, lambda: _print_serving(engine, args))
    controller.server = server
    if threading.current_thread() is threading.main_thread():
        # uvicorn installs its own handlers while it serves and restores these afterwards.
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, frame: controller.on_signal(signum))
    return server


def run_server(args: argparse.Namespace, sock: socket.socket) -> int:
    """Load the engine, serve on `sock` (`listen.bind_or_exit`: bound here, or the
    supervisor's) until a signal or engine death; returns the exit status
    (0 after a signal, 1 after engine death, 2 for a configuration that cannot serve,
    128 + signal for a signal before the server was up)."""
    startup.configure_logging()
    startup.install_start_up_signals()
    try:
        check_serve_args(args)
        server = _build_server(_start_engine(args), args)
    except ValueError as exc:
        print(f"kvflow serve: error: {exc}", file=sys.stderr, flush=True)
        return 2
    except EngineStartError as exc:  # the engine process said why on stderr
        return exc.code if exc.code > 0 else 1
    controller = server.controller
    code = None
    try:
        server.run(sockets=[sock])
    except SystemExit as exc:  # uvicorn's exit when its start-up fails
        code = exc.code if isinstance(exc.code, int) else 1
    except OSError as exc:  # another server bound the port too, and listened first
        logger.error("cannot listen on %s:%d: %s", args.host, args.port, exc)
        code = 1
    finally:
        controller.engine.close()
    status = controller.exit_code if code is None else code
    if controller.engine.threads_alive():
        logger.error("engine thread still running after shutdown; exiting hard")
        _exit_now(status or 1)
    return _finish(status, args)


def _finish(status: int, args: argparse.Namespace) -> int:
    if getattr(args, "exit_fast", True):
        _exit_now(status)
    return status


def _exit_now(status: int) -> None:
    """Everything of ours is stopped and joined; skip only the interpreter's teardown of torch
    and friends (1.5-2 s on a small CPU), so the process ends within a second of its last
    answer. atexit handlers still run."""
    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def main(argv: list[str] | None = None) -> int:
    """`python -m kvflow.server.api_server [flags]`: `kvflow serve`, or an API server that the
    --api-server-count supervisor started (its flags in the environment)."""
    parser = argparse.ArgumentParser(prog="kvflow serve")
    add_serve_arguments(parser)
    args = args_from_env() or parser.parse_args(argv)
    return run(args, bind_or_exit(args))


def run(args: argparse.Namespace, sock: socket.socket) -> int:
    """`kvflow serve` on `sock` (`listen.bind_or_exit`): one API server process over the
    engine process, or with --api-server-count N > 1 a supervisor of N of them
    (`api_servers`)."""
    if args.api_server_count > 1 and args.engine_address is None:
        from kvflow.server.api_servers import run_supervisor

        return run_supervisor(args, sock)
    return run_server(args, sock)


if __name__ == "__main__":
    sys.exit(main())

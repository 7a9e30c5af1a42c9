"""The HTTP front end's deployment options, with vLLM's flag names: CORS
(`--allowed-origins` ...), `X-Request-Id` on every response (`--enable-request-id-headers`),
a request-body size limit (`--max-request-body-bytes`: 413 at once, never a hang), and the
periodic stats log line (off with `--disable-log-stats`)."""

from __future__ import annotations

import logging
import time
import uuid

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvflow.engine.async_stats import IterationStats
from kvflow.server.http import error_json
from kvflow.server.serving import ServingError

logger = logging.getLogger("kvflow.server")


def install_frontend(app: FastAPI, args) -> None:
    """Middleware in the order a request meets it: body limit, request id, CORS. Flags
    missing from `args` (an app built in a test) leave their middleware out."""
    if not hasattr(args, "allowed_origins"):
        return
    app.add_middleware(
        CORSMiddleware,
        allow_origins=args.allowed_origins,
        allow_credentials=args.allow_credentials,
        allow_methods=args.allowed_methods,
        allow_headers=args.allowed_headers,
    )
    if args.enable_request_id_headers:
        app.add_middleware(RequestIdMiddleware)
    if args.max_request_body_bytes:
        app.add_middleware(BodyLimitMiddleware, limit=args.max_request_body_bytes)


class RequestIdMiddleware:
    """Echoes the request's `X-Request-Id` on the response, or makes one (uuid4 hex)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = Headers(scope=scope).get("x-request-id") or uuid.uuid4().hex

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)["X-Request-Id"] = request_id
            await send(message)

        await self.app(scope, receive, send_with_id)


class BodyLimitMiddleware:
    """A body over `limit` bytes gets a 413: at once from its Content-Length; a body without
    one (chunked) is read here, up to the limit, before the app sees it."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = Headers(scope=scope).get("content-length")
        if length is not None:
            if length.isdigit() and int(length) > self.limit:
                await self._refuse(scope, receive, send)
            else:
                await self.app(scope, receive, send)
            return
        buffered: list[Message] = []
        seen = 0
        while True:
            message = await receive()
            buffered.append(message)
            if message["type"] != "http.request":
                break
            seen += len(message.get("body", b""))
            if seen > self.limit:
                await self._refuse(scope, receive, send)
                return
            if not message.get("more_body", False):
                break

        async def replay() -> Message:
            return buffered.pop(0) if buffered else await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = f"Request body too large: the limit is {self.limit} bytes."
        response = error_json(ServingError(message, 413), scope["path"])
        response.headers["Connection"] = "close"
        await response(scope, receive, send)


class LoggingStatLogger:
    """vLLM's periodic log line: throughputs over the interval, queue and KV-cache usage, the
    prefix-cache hit rate. Logs only intervals that saw work."""

    def __init__(self, interval: float = 10.0) -> None:
        self.interval = interval
        self._reset()

    def _reset(self) -> None:
        self._start = time.monotonic()
        self._prompt = self._generation = self._queries = self._hits = 0
        self._active = False

    def record(self, stats: IterationStats) -> None:
        self._prompt += stats.num_prompt_tokens
        self._generation += stats.num_generation_tokens
        self._queries += stats.prefix_cache_queries
        self._hits += stats.prefix_cache_hits
        self._active = self._active or stats.num_iteration_tokens is not None
        now = time.monotonic()
        if now - self._start < self.interval:
            return
        if self._active:
            elapsed, engine = now - self._start, stats.engine
            logger.info(
                "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f "
                "tokens/s, Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, "
                "Prefix cache hit rate: %.1f%%",
                self._prompt / elapsed,
                self._generation / elapsed,
                engine.num_running,
                engine.num_waiting,
                100 * engine.kv_cache_usage,
                100 * self._hits / self._queries if self._queries else 0.0,
            )
        self._reset()


class StatLoggers:
    """Several StatLoggers behind one `record`."""

    def __init__(self, *loggers) -> None:
        self.loggers = [x for x in loggers if x is not None]

    def record(self, stats: IterationStats) -> None:
        for stat_logger in self.loggers:
            stat_logger.record(stats)

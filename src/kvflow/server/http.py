"""HTTP plumbing around the routes: the API-key guard, vLLM-shaped error responses, a true
OpenAPI document, and an SSE response that notices a client leaving."""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Awaitable
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from kvflow.server.protocol import STREAM_CHUNK_MODELS, AnthropicErrorResponse, ErrorResponse
from kvflow.server.serving import EventStream, ServingError

logger = logging.getLogger("kvflow.server")
T = TypeVar("T")

ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": description}
    for status, description in (
        (400, "Invalid request"),
        (401, "Missing or wrong API key (with --api-key)"),
        (404, "Unknown model"),
        (408, "The request ran past its timeout"),
        (413, "The request body is over --max-request-body-bytes"),
        (500, "The request failed in the engine"),
        (503, "Shutting down, queue full, or engine dead"),
    )
}


ANTHROPIC_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": AnthropicErrorResponse, "description": description}
    for status, description in (
        (400, "Invalid request (invalid_request_error)"),
        (401, "Missing or wrong API key (authentication_error)"),
        (404, "Unknown model (not_found_error)"),
        (408, "The request ran past its timeout (timeout_error)"),
        (413, "The request body is over --max-request-body-bytes (request_too_large)"),
        (500, "The request failed in the engine (api_error)"),
        (529, "Shutting down, queue full, or engine dead (overloaded_error)"),
    )
}
ANTHROPIC_PATHS = "/v1/messages"  # the routes that answer in Anthropic's error shape


def error_json(err: ServingError, path: str = "") -> JSONResponse:
    """The error as the route at `path` shapes it: Anthropic's under /v1/messages, else
    vLLM's."""
    if path.startswith(ANTHROPIC_PATHS):
        body, status = err.anthropic()
        return JSONResponse(body.model_dump(), status_code=status, headers=err.headers)
    return JSONResponse(err.body().model_dump(), status_code=err.status, headers=err.headers)


class ApiKeyMiddleware:
    """`--api-key`: every /v1 route needs `Authorization: Bearer <key>`, or `x-api-key: <key>`
    as Anthropic's clients send it (401 otherwise)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] == "http"
            and scope["method"] != "OPTIONS"
            and scope["path"].startswith("/v1")
        ):
            headers = Headers(scope=scope)
            given = headers.get("authorization", "").encode()
            keyed = headers.get("x-api-key", "").encode()
            if not (
                secrets.compare_digest(given, self.expected)
                or secrets.compare_digest(keyed, self.key)
            ):
                refusal = error_json(ServingError("Unauthorized", 401), scope["path"])
                await refusal(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _validation_message(request: Request, exc: RequestValidationError) -> str:
    """A body that is not JSON is named as such: FastAPI reads a body as JSON only when its
    Content-Type says so (or is missing), and otherwise reports a dictionary it did not get."""
    content_type = request.headers.get("content-type")
    if content_type is not None and not _is_json(content_type):
        return f"Content-Type must be application/json, got {content_type}."
    parts = []
    for err in exc.errors():
        if err.get("type") == "json_invalid":
            return f"Invalid JSON body: {err.get('ctx', {}).get('error', 'cannot be parsed')}"
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        parts.append(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")))
    return "; ".join(parts) or "Invalid request."


def _is_json(content_type: str) -> bool:
    """FastAPI's rule: application/json or application/*+json, parameters aside."""
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (
        media.startswith("application/") and media.endswith("+json")
    )


def install_error_handlers(app: FastAPI) -> None:
    async def serving_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ServingError)
        return error_json(exc, request.url.path)

    async def validation_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        message = _validation_message(request, exc)
        return error_json(ServingError(message, 400), request.url.path)

    async def http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        return error_json(ServingError(str(exc.detail), exc.status_code), request.url.path)

    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error", exc_info=exc)
        return error_json(ServingError(f"Internal error: {exc}", 500), request.url.path)

    app.add_exception_handler(ServingError, serving_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, unexpected)


def install_openapi(app: FastAPI) -> None:
    """FastAPI's document, made true: validation errors are 400 (not 422), and the SSE chunk
    schemas are components the event-stream responses refer to."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for model in STREAM_CHUNK_MODELS:
            chunk = model.model_json_schema(
                ref_template="#/components/schemas/{model}", mode="serialization"
            )
            for name, definition in chunk.pop("$defs", {}).items():
                components.setdefault(name, definition)
            components[model.__name__] = chunk
        for path in schema.get("paths", {}).values():
            for operation in path.values():
                operation.get("responses", {}).pop("422", None)
        components.pop("HTTPValidationError", None)
        components.pop("ValidationError", None)
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def sse_responses(chunk_model: str) -> dict[int | str, dict[str, Any]]:
    ref = {"$ref": f"#/components/schemas/{chunk_model}"}
    stream = {
        200: {
            "description": "JSON, or with `stream: true` Server-Sent Events: `data: <chunk>` "
            "lines, an error event if the request fails mid-stream, then `data: [DONE]`",
            "content": {"text/event-stream": {"schema": ref}},
        }
    }
    return {**stream, **ERROR_RESPONSES}


async def _disconnected(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def with_disconnect(request: Request, work: Awaitable[T]) -> T | None:
    """Await `work`, cancelling it if the client goes away first (then returns None).
    Cancelling a request's consumer aborts it in the engine and frees its blocks."""
    task = asyncio.ensure_future(work)
    listener = asyncio.ensure_future(_disconnected(request.receive))
    try:
        await asyncio.wait({task, listener}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        listener.cancel()
        if not task.done():
            task.cancel()
    try:
        return await task
    except asyncio.CancelledError:
        if listener.cancelled() or not listener.done():
            raise
        logger.info("client disconnected; request aborted")
        return None


class SSEResponse(StreamingResponse):
    """Streams an EventStream; a disconnect cancels the body at once (whatever the ASGI spec
    version), and closing always aborts the requests behind it."""

    media_type = "text/event-stream"

    def __init__(self, stream: EventStream) -> None:
        super().__init__(stream.body, media_type=self.media_type)
        self.stream = stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        sender = asyncio.ensure_future(self.stream_response(send))
        listener = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait({sender, listener}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (sender, listener):
                task.cancel()
            await asyncio.gather(sender, listener, return_exceptions=True)
            self.stream.close()
            await self.stream.body.aclose()  # type: ignore[attr-defined]

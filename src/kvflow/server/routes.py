"""The routes: thin adapters from HTTP to the serving layer (vLLM's paths and shapes)."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response

from kvflow.engine.async_llm import AsyncEngine
from kvflow.server.engine_view import MAX_HISTORY_S, SnapshotCache
from kvflow.server.http import (
    ANTHROPIC_ERROR_RESPONSES,
    ERROR_RESPONSES,
    SSEResponse,
    error_json,
    sse_responses,
    with_disconnect,
)
from kvflow.server.metrics import CONTENT_TYPE_LATEST, ServerMetrics
from kvflow.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    VersionResponse,
)
from kvflow.server.serving import EventStream, ServingError
from kvflow.server.serving_chat import ChatServing
from kvflow.server.serving_completion import CompletionServing
from kvflow.server.serving_messages import (
    CountTokensRequest,
    CountTokensResponse,
    MessageResponse,
    MessagesRequest,
    MessagesServing,
)

router = APIRouter()

_CLIENT_CLOSED = 499  # nginx's "client closed request": nobody reads it


@dataclass
class ServerContext:
    engine: AsyncEngine
    completion: CompletionServing
    chat: ChatServing
    messages: MessagesServing
    metrics: ServerMetrics
    snapshots: SnapshotCache


def _ctx(request: Request) -> ServerContext:
    return request.app.state.ctx


def _health_response(request: Request) -> Response:
    engine = _ctx(request).engine
    if engine.is_healthy:
        return Response(status_code=200)
    if engine.dead_error is not None:
        reason = engine.dead_error
    elif not engine.accepting:
        reason = "The server is shutting down."
    else:
        reason = "An engine step has run longer than --watchdog-timeout."
    return error_json(ServingError(reason, 503))


_HEALTH = {
    200: {"description": "Healthy (empty body)", "content": None},
    503: {"model": ErrorResponse, "description": "Engine dead, stalled, or shutting down"},
}


@router.get("/health", response_class=Response, responses=_HEALTH)
async def health(request: Request) -> Response:
    return _health_response(request)


@router.get("/ping", response_class=Response, responses=_HEALTH)
@router.post("/ping", response_class=Response, responses=_HEALTH)
async def ping(request: Request) -> Response:
    return _health_response(request)


@router.get(
    "/metrics",
    response_class=Response,
    responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}},
)
async def metrics(request: Request) -> Response:
    ctx = _ctx(request)
    ctx.metrics.sync_front_end(ctx.engine.num_admission_rejections)
    return Response(ctx.metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.get("/version", response_model=VersionResponse)
async def version() -> VersionResponse:
    from kvflow import __version__

    return VersionResponse(version=__version__)


@router.get("/v1/models", response_model=ModelList, responses={401: ERROR_RESPONSES[401]})
async def models(request: Request) -> ModelList:
    return _ctx(request).completion.models()


@router.post("/tokenize", response_model=TokenizeResponse, responses=ERROR_RESPONSES)
async def tokenize(body: TokenizeRequest, request: Request) -> TokenizeResponse:
    return _ctx(request).chat.tokenize(body)  # a chat's prompt as the chat endpoint renders it


@router.post("/detokenize", response_model=DetokenizeResponse, responses=ERROR_RESPONSES)
async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
    return _ctx(request).completion.detokenize(body)


def _respond(result: object) -> Response:
    if result is None:
        return Response(status_code=_CLIENT_CLOSED)
    if isinstance(result, EventStream):
        return SSEResponse(result)
    return JSONResponse(result.model_dump())  # type: ignore[attr-defined]


@router.post(
    "/v1/completions",
    response_model=CompletionResponse,
    responses=sse_responses("CompletionStreamResponse"),
)
async def completions(body: CompletionRequest, request: Request) -> Response:
    serving = _ctx(request).completion
    return _respond(await with_disconnect(request, serving.create_completion(body)))


@router.post(
    "/v1/chat/completions",
    response_model=ChatCompletionResponse,
    responses=sse_responses("ChatCompletionStreamResponse"),
)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    serving = _ctx(request).chat
    return _respond(await with_disconnect(request, serving.create_chat_completion(body)))


_MESSAGES = {
    200: {
        "description": "JSON, or with `stream: true` Server-Sent Events in Anthropic's form: "
        "`event: <type>` and `data: <event>` lines, message_start to message_stop (or an "
        "error event if the request fails mid-stream)",
        "content": {"text/event-stream": {"schema": {"type": "string"}}},
    },
    **ANTHROPIC_ERROR_RESPONSES,
}


@router.post("/v1/messages", response_model=MessageResponse, responses=_MESSAGES)
async def messages(body: MessagesRequest, request: Request) -> Response:
    """Anthropic's Messages API (errors in its shape: `http.error_response`)."""
    serving = _ctx(request).messages
    return _respond(await with_disconnect(request, serving.create_message(body)))


@router.post(
    "/v1/messages/count_tokens",
    response_model=CountTokensResponse,
    responses=ANTHROPIC_ERROR_RESPONSES,
)
async def count_message_tokens(body: CountTokensRequest, request: Request) -> CountTokensResponse:
    return _ctx(request).messages.count_tokens(body)


_SNAPSHOT = {
    200: {
        "description": "kvflow's live engine view: the KV pool block by block, running and "
        "waiting requests (by reason), events, and per-second history rows",
        "content": {"application/json": {"schema": {"type": "object"}}},
    },
    401: ERROR_RESPONSES[401],
    400: ERROR_RESPONSES[400],
}


@router.get("/v1/engine/snapshot", response_class=JSONResponse, responses=_SNAPSHOT)
async def engine_snapshot(
    request: Request, history_s: int = Query(120, ge=0, le=MAX_HISTORY_S)
) -> JSONResponse:
    return JSONResponse(await _ctx(request).snapshots.get(history_s))

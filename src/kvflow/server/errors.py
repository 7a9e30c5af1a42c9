"""The errors a client can cause or meet, as vLLM shapes them: a status, vLLM's error type and a
message that names the numbers."""

from __future__ import annotations

from kvflow.engine.async_llm import EngineDeadError, EngineUnavailableError
from kvflow.server.protocol import (
    AnthropicErrorInfo,
    AnthropicErrorResponse,
    ErrorInfo,
    ErrorResponse,
)

ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "RequestTimeoutError",
    413: "RequestEntityTooLargeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}
# Anthropic's error types by status (its API reference), for /v1/messages
ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}
ANTHROPIC_STATUS = {503: 529}  # queue full, shutting down, engine dead: "overloaded"


class ServingError(Exception):
    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.headers = headers

    def body(self) -> ErrorResponse:
        err_type = ERROR_TYPES.get(self.status, "BadRequestError")
        return ErrorResponse(
            error=ErrorInfo(message=self.message, type=err_type, param=self.param, code=self.status)
        )

    def anthropic(self) -> tuple[AnthropicErrorResponse, int]:
        """(Anthropic's body for this error, its status: 503 is Anthropic's 529)."""
        status = ANTHROPIC_STATUS.get(self.status, self.status)
        default = "api_error" if status >= 500 else "invalid_request_error"
        kind = ANTHROPIC_ERROR_TYPES.get(status, default)
        return AnthropicErrorResponse(
            error=AnthropicErrorInfo(type=kind, message=self.message)
        ), status


def engine_error(exc: Exception) -> ServingError:
    """ValueError -> 400; queue full or shutting down -> 503 (+ Retry-After); dead -> 503."""
    if isinstance(exc, EngineUnavailableError):
        headers = {"Retry-After": str(exc.retry_after)} if exc.retry_after else None
        return ServingError(str(exc), 503, headers=headers)
    if isinstance(exc, EngineDeadError):
        return ServingError(str(exc), 503)
    return ServingError(str(exc), 400)

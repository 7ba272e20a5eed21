"""HTTP errors: one exception type carrying the status, rtp-llm's error_code and the message,
and the mapping from rtpkv's exceptions to it."""

from __future__ import annotations

import enum
from typing import Any, Optional

from rtpkv.errors import (CapacityError, ConfigError, EmptyPromptError, EngineStoppedError,
                          PromptTooLongError, RequestError, RequestTimeoutError, UnknownTaskError)


class ErrorCode(enum.IntEnum):
    """rtp-llm's error codes (rtp_llm ExceptionType) for the native route; ENGINE_STOPPED and
    REQUEST_TOO_LARGE are rtpkv's own (rtp-llm has no code for a server that is shutting down
    or for a body over the server's limit)."""

    CONCURRENCY_LIMIT_ERROR = 409
    REQUEST_TOO_LARGE = 413
    CANCELLED_ERROR = 499
    ENGINE_STOPPED = 503
    ERROR_INPUT_FORMAT_ERROR = 507
    NO_PROMPT_ERROR = 509
    EMPTY_PROMPT_ERROR = 510
    LONG_PROMPT_ERROR = 511
    UNKNOWN_ERROR = 514
    GENERATE_TIMEOUT = 603
    ERROR_GENERATE_CONFIG_FORMAT = 604
    EXCEEDS_KV_CACHE_MAX_LEN = 8105


class ApiError(Exception):
    """An error answered as JSON: rtp-llm's {"error_code", "message"} on the native route,
    OpenAI's {"error": {...}} on /v1."""

    def __init__(self, status: int, code: ErrorCode, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.status, self.code, self.message, self.param = status, code, message, param
        self.counted = False  # already in rtpkv_requests_total (the request's stream ended)

    @property
    def outcome(self) -> str:
        """The `outcome` label of rtpkv_requests_total for this error."""
        return {400: "invalid", 404: "invalid", 413: "invalid", 409: "rejected",
                503: "unavailable", 504: "timeout"}.get(self.status, "error")

    def native_body(self) -> dict[str, Any]:
        return {"error_code": int(self.code), "message": self.message}

    def openai_body(self) -> dict[str, Any]:
        kind = {400: "invalid_request_error", 404: "invalid_request_error",
                413: "invalid_request_error",
                409: "rate_limit_error", 503: "service_unavailable_error",
                504: "timeout_error"}.get(self.status, "server_error")
        code = "context_length_exceeded" if self.code == ErrorCode.LONG_PROMPT_ERROR \
            else self.code.name.lower()
        return {"error": {"message": self.message, "type": kind, "param": self.param,
                          "code": code}}


ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                         403: "permission_error", 404: "not_found_error",
                         413: "request_too_large", 409: "rate_limit_error",
                         429: "rate_limit_error", 503: "overloaded_error"}


def anthropic_body(err: ApiError) -> dict[str, Any]:
    """Anthropic's error object: {"type": "error", "error": {"type", "message"}}."""
    return {"type": "error", "error": {"type": ANTHROPIC_ERROR_TYPES.get(err.status, "api_error"),
                                       "message": err.message}}


def api_error(exc: BaseException) -> ApiError:
    """The HTTP answer for an exception raised by the pipeline (or the server itself)."""
    if isinstance(exc, ApiError):
        return exc
    message = str(exc)
    if isinstance(exc, PromptTooLongError):
        return ApiError(400, ErrorCode.LONG_PROMPT_ERROR, message)
    if isinstance(exc, UnknownTaskError):
        return ApiError(400, ErrorCode.ERROR_INPUT_FORMAT_ERROR, message, "task_id")
    if isinstance(exc, CapacityError):
        return ApiError(400, ErrorCode.EXCEEDS_KV_CACHE_MAX_LEN, message)
    if isinstance(exc, ConfigError):
        return ApiError(400, ErrorCode.ERROR_GENERATE_CONFIG_FORMAT, message)
    if isinstance(exc, EmptyPromptError):
        return ApiError(400, ErrorCode.EMPTY_PROMPT_ERROR, message)
    if isinstance(exc, RequestError):
        return ApiError(400, ErrorCode.ERROR_INPUT_FORMAT_ERROR, message)
    if isinstance(exc, EngineStoppedError):
        return ApiError(503, ErrorCode.ENGINE_STOPPED, message)
    if isinstance(exc, RequestTimeoutError):
        return ApiError(504, ErrorCode.GENERATE_TIMEOUT, message)
    return ApiError(500, ErrorCode.UNKNOWN_ERROR, f"{type(exc).__name__}: {message}")

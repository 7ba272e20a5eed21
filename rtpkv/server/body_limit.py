"""A bound on request bodies, checked before any of the body is parsed: a declared
Content-Length over the bound is answered 413 at once, and a chunked body is cut off (413) as
soon as it passes the bound, so no client can make the server hold or parse megabytes."""

from __future__ import annotations

from typing import Any, Awaitable, Callable

import orjson

from rtpkv.server.errors import ApiError, ErrorCode

DEFAULT_MAX_BODY_MB = 16.0
Scope = dict[str, Any]
Message = dict[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]],
                   Awaitable[None]]


def too_large(max_bytes: int) -> ApiError:
    return ApiError(413, ErrorCode.REQUEST_TOO_LARGE,
                    f"request body is larger than the server's limit of {max_bytes} bytes "
                    "(MAX_REQUEST_BODY_MB)")


class BodyLimit:
    """ASGI middleware: bodies up to `max_bytes`; errors in the route's shape (OpenAI on /v1)."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Callable[[], Awaitable[Message]],
                       send: Callable[[Message], Awaitable[None]]) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(scope, send)
            return
        received = 0

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise too_large(self.max_bytes)  # the app answers it in the route's shape
            return message

        await self.app(scope, limited, send)

    async def _refuse(self, scope: Scope, send: Callable[[Message], Awaitable[None]]) -> None:
        err = too_large(self.max_bytes)
        body = orjson.dumps(err.openai_body() if scope["path"].startswith("/v1")
                            else err.native_body())
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})

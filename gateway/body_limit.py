"""A cap on the size of request bodies, as pure ASGI middleware.

A body over the cap is answered 413 in OpenAI's error shape without being read whole: at once when its
``Content-Length`` says so, and otherwise (a chunked body) as soon as the bytes the app has read pass the cap,
so the gateway never holds more than the cap plus one chunk. Being plain ASGI, it works the same under
uvicorn and behind Ray Serve's proxy, which hands the replica the body in messages as it arrives.
"""

from __future__ import annotations

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.protocol import APIError


class BodyTooLarge(APIError):
    """413: the request body is over ``max_body_bytes``."""

    def __init__(self, limit: int, declared: int | None = None) -> None:
        size = f"has {declared} bytes" if declared is not None else "is larger than that"
        super().__init__(
            413,
            f"the request body {size}; the limit is {limit} bytes (max_body_bytes)",
            code="request_too_large",
        )


def _content_length(scope: Scope) -> int | None:
    for k, v in scope.get("headers", []):
        if k.lower() == b"content-length":
            try:
                return int(v)
            except ValueError:
                return None  # the server refuses a malformed one; counting still bounds the body
    return None


class BodyLimitMiddleware:
    """413 for a request body over ``limit`` bytes, before it is read whole."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.limit:
            # Nothing of the body has been read: with `Expect: 100-continue` the client never sends it.
            await _answer(BodyTooLarge(self.limit, declared), scope, receive, send)
            return
        received = 0
        started = False

        async def counted_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    # Raised inside the route's read of the body: the app answers it as any APIError.
                    raise BodyTooLarge(self.limit)
            return message

        async def tracked_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, tracked_send)
        except BodyTooLarge as e:
            # Read outside a handler that answers errors: answer here while nothing has been sent.
            if started:
                raise
            await _answer(e, scope, receive, send)


async def _answer(err: APIError, scope: Scope, receive: Receive, send: Send) -> None:
    await JSONResponse(err.body(), status_code=err.status)(scope, receive, send)

"""A cap on request bodies, enforced before anything parses them.

Without it, a 48 MB prompt was read whole, decoded as JSON and tokenized before being refused
(127 s, and the server grew to 13 GB). `BodyLimitMiddleware` answers 413 at once when the
declared Content-Length is over the limit, without reading a byte of the body, and counts the
bytes of a body sent without a length (chunked) as they arrive, stopping at the limit.
"""

from __future__ import annotations

from starlette.exceptions import HTTPException

from .errors import APIError

DEFAULT_MAX_BODY = 4 << 20  # 4 MiB: ~1M tokens of text, far past any context served here


class BodyTooLarge(HTTPException):
    """Raised from `receive` while a chunked body is read: FastAPI re-raises HTTPExceptions it
    meets while reading a body (others become a generic 400), so the app's handler answers."""

    def __init__(self, limit: int):
        super().__init__(413, too_large_message(limit))


def too_large_message(limit: int) -> str:
    return (f"the request body is larger than this server accepts ({limit} bytes); send a "
            f"shorter prompt, or start the server with a larger --max-body")


class BodyLimitMiddleware:
    """Pure ASGI, so that the early 413 needs no request object and no body read."""

    def __init__(self, app, max_body: int, on_refused=None):
        self.app = app
        self.max_body = max_body
        self.on_refused = on_refused  # called with the error code of an early refusal

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = None
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    return await self._refuse(send, APIError(
                        400, f"Content-Length {value[:40]!r} is not a number",
                        code="invalid_content_length"))
                if declared < 0:
                    return await self._refuse(send, APIError(
                        400, f"Content-Length {declared} is negative",
                        code="invalid_content_length"))
        if declared is not None and declared > self.max_body:
            return await self._refuse(send, APIError(413, too_large_message(self.max_body),
                                                     code="request_too_large"))
        seen = 0

        async def counting_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body:
                    raise BodyTooLarge(self.max_body)
            return message

        await self.app(scope, counting_receive, send)

    async def _refuse(self, send, err: APIError) -> None:
        if self.on_refused is not None:
            self.on_refused(err.code)
        response = err.response()
        # the body is left unread: tell the client this connection ends with the answer
        response.headers["Connection"] = "close"
        await response({"type": "http"}, _no_body, send)


async def _no_body():
    return {"type": "http.disconnect"}

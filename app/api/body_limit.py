"""The request-body limit: a body whose `Content-Length` exceeds `max_bytes` is answered 413
`{"error": "body: ...", "field": "body"}` before any route reads it. (Routes that stream a body
of their own, like the vector upload, check their own, smaller limit while reading.)

A plain ASGI middleware: Starlette's `BaseHTTPMiddleware` (`@app.middleware("http")`) wraps every
request in a task group and memory streams, which cost more per request than a small completion's
own handler (docs/performance.md, "Eighteenth session")."""

from __future__ import annotations

from fastapi import FastAPI

from app.api.errors import error_response


class BodyLimit:
    """ASGI middleware: HTTP requests with a `Content-Length` over `max_bytes` get the 413."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            for name, value in scope["headers"]:
                if name == b"content-length":
                    length = value.decode("latin-1")
                    if length.isdigit() and int(length) > self.max_bytes:
                        response = error_response(413, f"body: request body of {length} bytes exceeds {self.max_bytes}", "body")
                        await response(scope, receive, send)
                        return
                    break
        await self.app(scope, receive, send)


def install_body_limit(app: FastAPI, max_bytes: int) -> None:
    app.add_middleware(BodyLimit, max_bytes=max_bytes)

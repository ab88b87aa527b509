"""The request-body limit: a body whose `Content-Length` exceeds `max_bytes` is answered 413
`{"error": "body: ...", "field": "body"}` before any route reads it. (Routes that stream a body
of their own, like the vector upload, check their own, smaller limit while reading.)"""

from __future__ import annotations

from fastapi import FastAPI, Request

from app.api.errors import error_response


def install_body_limit(app: FastAPI, max_bytes: int) -> None:
    @app.middleware("http")
    async def limit_body(request: Request, call_next):
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > max_bytes:
            return error_response(413, f"body: request body of {length} bytes exceeds {max_bytes}", "body")
        return await call_next(request)

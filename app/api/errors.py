"""One error shape for every 4xx/5xx: `{"error": "<field>: <message>", "field": ..., "errors": [...]}`.

The `error` string keeps the reference fork's `{"error": "<message>"}` shape, so its clients keep
working; `field` names the offending request field for programs.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine_ext.errors import EngineDeadError, SpecError


def error_response(status: int, message: str, field: str | None = None, errors: list[dict] | None = None) -> JSONResponse:
    body: dict = {"error": message, "field": field}
    if errors is not None:
        body["errors"] = errors
    return JSONResponse(body, status_code=status)


def _field_of(loc: tuple) -> str:
    parts = [str(p) for p in loc if p != "body"]
    return ".".join(parts) if parts else "body"


def _describe(err: dict) -> dict:
    kind = err.get("type", "")
    field = "body" if kind == "json_invalid" else _field_of(tuple(err.get("loc", ())))
    if kind == "extra_forbidden":
        msg = "unknown field (not part of this request's schema)"
    elif kind == "missing":
        msg = "required field is missing"
    elif kind == "json_invalid":
        msg = f"request body is not valid JSON ({err.get('ctx', {}).get('error', 'parse error')})"
    else:
        msg = err.get("msg", "invalid value")
    return {"field": field, "message": msg, "type": kind}


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [_describe(e) for e in exc.errors()]
        first = errors[0] if errors else {"field": "body", "message": "invalid request"}
        return error_response(400, f"{first['field']}: {first['message']}", first["field"], errors)

    @app.exception_handler(SpecError)
    async def _spec(_: Request, exc: SpecError) -> JSONResponse:
        return error_response(400, str(exc), exc.field)

    @app.exception_handler(EngineDeadError)
    async def _dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        return error_response(503, str(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))

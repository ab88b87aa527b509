"""One error shape for every 4xx/5xx: `{"error": "<field>: <message>", "field": ..., "errors": [...]}`.

The `error` string keeps the reference fork's `{"error": "<message>"}` shape, so its clients keep
working; `field` names the offending request field for programs, in one format whoever found
the problem (pydantic, a `SpecError` from `engine_ext`, a route): object keys joined by dots,
list indices in brackets — `interventions.steer[0].scale`, `vectors.post_block.3` (a dict key).
`install_error_handlers` maps every exception the API raises on purpose to that shape.
"""

from __future__ import annotations

from collections.abc import Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine_ext.errors import EngineDeadError, SpecError

#: where FastAPI found a value (the first element of a pydantic `loc`); not part of a field's name
_LOCATIONS = ("body", "query", "path", "header", "cookie")
#: union branch names pydantic gives plain types (models are named by their class)
_TYPE_NAMES = frozenset({"str", "int", "float", "bool", "bytes", "none"})


class AuthError(Exception):
    """A guarded request without the right bearer token: 401 naming `authorization`
    (`app/api/auth.py` raises it)."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


def error_response(status: int, message: str, field: str | None = None, errors: list[dict] | None = None) -> JSONResponse:
    body: dict = {"error": message, "field": field}
    if errors is not None:
        body["errors"] = errors
    return JSONResponse(body, status_code=status)


def _is_union_branch(part: str) -> bool:
    """pydantic names the branch of a union an error came from inside its `loc` ('str',
    'SpanSpec', 'list[union[int,SpanSpec]]', "literal['all']", 'function-after[...]'); request
    field names are snake_case, so such a part is never a field."""
    return part in _TYPE_NAMES or part[:1].isupper() or not part.replace("_", "").isalnum()


def _parts(loc: Sequence[str | int]) -> tuple[list[str | int], int | None]:
    """The field parts of a pydantic `loc` (no location, no union branches) and how many of
    them come before the first union branch (None: no union on the way)."""
    parts = list(loc)
    if parts and parts[0] in _LOCATIONS:
        parts = parts[1:]
    out: list[str | int] = []
    union_at = None
    for part in parts:
        if isinstance(part, str) and _is_union_branch(part):
            union_at = len(out) if union_at is None else union_at
        else:
            out.append(part)
    return out, union_at


def _join(parts: Sequence[str | int]) -> str:
    path = ""
    for part in parts:
        if isinstance(part, int) and not isinstance(part, bool):
            path = f"{path or 'body'}[{part}]"
        else:
            path = f"{path}.{part}" if path else str(part)
    return path or "body"


def field_path(loc: Sequence[str | int]) -> str:
    """A pydantic error `loc` in the API's field-path format: `("body", "interventions", "steer",
    0, "scale")` -> `interventions.steer[0].scale`. The leading location (`body`, `query`, ...)
    and union branch names are dropped; an empty path is `body` (the whole body)."""
    return _join(_parts(loc)[0])


def _describe(err: dict) -> dict:
    kind = err.get("type", "")
    field = "body" if kind == "json_invalid" else field_path(tuple(err.get("loc", ())))
    if kind == "extra_forbidden":
        msg = "unknown field (not part of this request's schema)"
    elif kind == "missing":
        msg = "required field is missing"
    elif kind == "json_invalid":
        msg = f"request body is not valid JSON ({err.get('ctx', {}).get('error', 'parse error')})"
    else:
        msg = err.get("msg", "invalid value")
    return {"field": field, "message": msg, "type": kind}


def _headline(errors: list[dict]) -> int:
    """Index of the error the message leads with: the first, or — when the first comes from a
    union whose every branch failed (pydantic reports each) — the branch error of that union
    that got furthest into the value (`positions[1].span` rather than `positions`: not a string)."""
    parts = [_parts(tuple(e.get("loc", ()))) for e in errors]
    first, union_at = parts[0]
    if union_at is None:
        return 0
    root = first[:union_at]
    same = [k for k, (p, u) in enumerate(parts) if u == union_at and p[:union_at] == root]
    return max(same, key=lambda k: len(parts[k][0]))


def install_error_handlers(app: FastAPI) -> None:
    """Answer validation errors (400), `SpecError` (400), `AuthError` (401), `EngineDeadError`
    (503) and HTTP exceptions in the one error shape."""

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        raw = list(exc.errors())
        errors = [_describe(e) for e in raw]
        first = errors[_headline(raw)] if errors else {"field": "body", "message": "invalid request"}
        return error_response(400, f"{first['field']}: {first['message']}", first["field"], errors)

    @app.exception_handler(SpecError)
    async def _spec(_: Request, exc: SpecError) -> JSONResponse:
        return error_response(getattr(exc, "status", 400), str(exc), exc.field)

    @app.exception_handler(AuthError)
    async def _unauthorized(_: Request, exc: AuthError) -> JSONResponse:
        resp = error_response(401, f"authorization: {exc.message}", "authorization")
        resp.headers["WWW-Authenticate"] = "Bearer"
        return resp

    @app.exception_handler(EngineDeadError)
    async def _dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        return error_response(503, f"engine: {exc}", "engine")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 400 and exc.detail == FASTAPI_BODY_PARSE_ERROR:
            return error_response(400, f"body: {_unparsable(exc.__cause__)}", "body")
        return error_response(exc.status_code, str(exc.detail))


#: FastAPI's detail when reading a JSON body raised something else than a JSON syntax error
FASTAPI_BODY_PARSE_ERROR = "There was an error parsing the body"


def _unparsable(cause: BaseException | None) -> str:
    """Why a body FastAPI could not parse is not a JSON document we accept."""
    if isinstance(cause, UnicodeDecodeError):
        return f"request body is not valid UTF-8 JSON ({cause.reason} at byte {cause.start})"
    if isinstance(cause, RecursionError):
        return "request body is not valid JSON (nested too deeply)"
    return f"request body could not be parsed as JSON ({type(cause).__name__ if cause else 'parse error'})"

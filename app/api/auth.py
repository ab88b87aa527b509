"""The API key that guards mutating endpoints.

When the app has a key (`create_app(api_key=...)`, else the `CAUSALBOARD_API_KEY` environment
variable; empty = no key), every endpoint that changes server state — global steering, named
vectors and modules, stored source runs (capture with `keep_as`, `DELETE /v1/patch_source/...`),
patch sweeps — needs `Authorization: Bearer <key>`; otherwise it answers
401 `{"error": "authorization: ...", "field": "authorization"}`. Read-only endpoints stay open.

Routes take the check as a dependency (`dependencies=[Depends(require_api_key)]`) or call
`check_api_key(request)` when only some requests mutate (e.g. a capture with `keep_as`).
"""

from __future__ import annotations

import hashlib
import os
import secrets

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from app.api.errors import error_response

API_KEY_ENV = "CAUSALBOARD_API_KEY"

#: OpenAPI entry for the 401 of guarded routes
UNAUTHORIZED = {401: {"description": "API key missing or wrong (only when the server has one)"}}


class AuthError(Exception):
    """A guarded request without the right bearer token (answered 401 by `install_auth`)."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


def resolve_api_key(api_key: str | None) -> str | None:
    """The effective key: `api_key` if given, else the environment's; '' or unset = none."""
    key = api_key if api_key is not None else os.environ.get(API_KEY_ENV)
    return key or None


def install_auth(app: FastAPI, api_key: str | None) -> None:
    """Store the effective key on `app.state.api_key` and answer `AuthError` with a 401."""
    app.state.api_key = resolve_api_key(api_key)

    @app.exception_handler(AuthError)
    async def _unauthorized(_: Request, exc: AuthError) -> JSONResponse:
        resp = error_response(401, f"authorization: {exc.message}", "authorization")
        resp.headers["WWW-Authenticate"] = "Bearer"
        return resp


def check_api_key(request: Request) -> None:
    """Raise `AuthError` unless the app has no key or the request carries it as a bearer token."""
    expected = getattr(request.app.state, "api_key", None)
    if not expected:
        return
    header = request.headers.get("authorization")
    if not header:
        raise AuthError("this endpoint changes server state and needs 'Authorization: Bearer <api key>'")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise AuthError("expected 'Authorization: Bearer <api key>'")
    # compare digests so the comparison time does not depend on the key's length
    given = hashlib.sha256(token.strip().encode()).digest()
    if not secrets.compare_digest(given, hashlib.sha256(expected.encode()).digest()):
        raise AuthError("invalid API key")


async def require_api_key(request: Request) -> None:
    """FastAPI dependency form of `check_api_key` (for routes that always mutate)."""
    check_api_key(request)

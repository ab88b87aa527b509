"""The API key that guards mutating endpoints.

When the app has a key (`create_app(api_key=...)`, else the `CAUSALBOARD_API_KEY` environment
variable; empty = no key; the effective key is `ApiSettings.api_key`), every endpoint that
changes server state — global steering, named vectors and modules, stored source runs (capture
with `keep_as`, `DELETE /v1/patch_source/...`), patch sweeps — needs
`Authorization: Bearer <key>`; otherwise it answers 401
`{"error": "authorization: ...", "field": "authorization"}` (`AuthError`, answered by
`app/api/errors.py`). Read-only endpoints stay open.

Routes that always mutate take `dependencies=[Depends(require_api_key)]`; routes where only some
requests mutate (a capture with `keep_as`) take `guard: ApiKeyGuard = Depends(api_key_guard)`
and call `guard.check()` for those.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from typing import NamedTuple

from fastapi import Depends, Request

from engine_ext import Engine

from app.api.deps import ApiSettings, engine_of, get_settings, running
from app.api.errors import AuthError

API_KEY_ENV = "CAUSALBOARD_API_KEY"

#: OpenAPI entry for the 401 of guarded routes
UNAUTHORIZED = {401: {"description": "API key missing or wrong (only when the server has one)"}}


def resolve_api_key(api_key: str | None) -> str | None:
    """The effective key: `api_key` if given, else the environment's; '' or unset = none."""
    key = api_key if api_key is not None else os.environ.get(API_KEY_ENV)
    return key or None


class ApiKeyGuard:
    """The key check of one request: `check()` raises `AuthError` unless the app has no key or
    the request's `Authorization` header carries it as a bearer token."""

    def __init__(self, expected: str | None, authorization: str | None):
        self.expected = expected
        self.authorization = authorization

    def check(self) -> None:
        if not self.expected:
            return
        if not self.authorization:
            raise AuthError("this endpoint changes server state and needs 'Authorization: Bearer <api key>'")
        scheme, _, token = self.authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise AuthError("expected 'Authorization: Bearer <api key>'")
        # compare digests so the comparison time does not depend on the key's length
        given = hashlib.sha256(token.strip().encode()).digest()
        if not secrets.compare_digest(given, hashlib.sha256(self.expected.encode()).digest()):
            raise AuthError("invalid API key")


async def api_key_guard(request: Request, settings: ApiSettings = Depends(get_settings)) -> ApiKeyGuard:
    """Dependency: the `ApiKeyGuard` of this request (for routes where only some requests mutate)."""
    return ApiKeyGuard(settings.api_key, request.headers.get("authorization"))


async def require_api_key(guard: ApiKeyGuard = Depends(api_key_guard)) -> None:
    """Dependency for routes that always mutate: 401 without the key."""
    guard.check()


class CompletionAccess(NamedTuple):
    """What a completion route needs, as one dependency: the running engine, the request's key
    guard and the settings."""

    engine: Engine
    guard: ApiKeyGuard
    settings: ApiSettings


async def completion_access(request: Request, settings: ApiSettings = Depends(get_settings)) -> CompletionAccess:
    """Dependency of the completion routes (`get_engine` + `api_key_guard` + `get_settings` in one:
    FastAPI solves every dependency of every request, and these routes carry the hottest traffic;
    overriding `get_settings` still applies)."""
    return CompletionAccess(running(engine_of(request.app)), ApiKeyGuard(settings.api_key, request.headers.get("authorization")),
                            settings)

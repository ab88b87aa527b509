"""What a route may depend on, as FastAPI dependencies: the engine, the API settings and the
patch-sweep service.

`create_app` stores them once with `install_state`; this module is the only one that knows
where (`app.state`). Routes declare what they need (`engine: Engine = Depends(get_engine)`),
so an app can be built, documented (OpenAPI) and tested with `app.dependency_overrides`
without a started engine.

* `get_engine` — the running engine; 503 (`EngineDeadError`) while it is not running (not
  started yet, or stopped).
* `engine_handle` — the engine whether it runs or not (for `/health` and `/v1/status`, which
  report its state).
* `get_settings` — `ApiSettings` (the API key, the body limit).
* `get_sweep_service` — the app's `SweepService`.
* `state_singleton` — an object kept on the app's state, created on first use (the fork's vector
  registry, the gates' conversation latches).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from fastapi import Depends, FastAPI, Request

from engine_ext import Engine
from engine_ext.errors import EngineDeadError

from app.sweep.service import SweepService

#: largest request body accepted (413 above it)
MAX_BODY_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True)
class ApiSettings:
    """Settings of one app. `api_key`: the effective key that guards mutating endpoints
    (`app/api/auth.py`), None when nothing is guarded."""

    api_key: str | None = None
    max_body_bytes: int = MAX_BODY_BYTES
    #: root of the fork's `filesystem` capture consumer (None: the consumer is not offered)
    capture_dir: str | None = None
    #: the fork's server-wide `logging` capture consumer (`app/api/compat/capture_log.py`), or None
    capture_log: Any = None


T = TypeVar("T")
_CREATE = threading.Lock()


def state_singleton(state: Any, attr: str, factory: Callable[[], T]) -> T:
    """`state.<attr>` (an app's `app.state`), created with `factory()` on first use; one object
    per app even when requests race to create it."""
    with _CREATE:
        got = getattr(state, attr, None)
        if got is None:
            got = factory()
            setattr(state, attr, got)
    return got


def install_state(app: FastAPI, engine: Engine, settings: ApiSettings, sweep_service: SweepService) -> None:
    app.state.engine = engine
    app.state.settings = settings
    app.state.sweep_service = sweep_service


def engine_of(app: FastAPI) -> Engine:
    """The app's engine (started or not); for the lifespan, which starts and stops it."""
    return app.state.engine


def settings_of(app: FastAPI) -> ApiSettings:
    """The app's settings; for code outside a request (the dashboard mount)."""
    return app.state.settings


def sweep_service_of(app: FastAPI) -> SweepService:
    return app.state.sweep_service


async def engine_handle(request: Request) -> Engine:
    """The app's engine, running or not."""
    return engine_of(request.app)


async def get_engine(engine: Engine = Depends(engine_handle)) -> Engine:
    """The app's engine; `EngineDeadError` (answered 503) unless it is running."""
    return running(engine)


def running(engine: Engine) -> Engine:
    """`engine`, or `EngineDeadError` (answered 503) unless it is running."""
    if not engine.alive:
        raise EngineDeadError("the vLLM engine is not running (not started yet, or stopped)")
    return engine


async def get_settings(request: Request) -> ApiSettings:
    return settings_of(request.app)


async def get_sweep_service(request: Request) -> SweepService:
    return sweep_service_of(request.app)

"""The causalboard HTTP API (FastAPI). Start it with `causalboard serve` (or `make run`).

`create_app(engine)` serves an already started `Engine` (tests share one engine per session);
`create_app(config=EngineConfig(...))` builds an engine that the app's lifespan starts and
stops — building the app starts nothing, so its OpenAPI schema and the routes that need no
model work without vLLM (routes that need the engine answer 503 until it runs). `api_key`
(else the `CAUSALBOARD_API_KEY` environment variable) guards mutating endpoints
(`app/api/auth.py`). Routes live in `app/api/routes/` and get the engine, settings and sweep
service as dependencies (`app/api/deps.py`).

Engine failure (docs/reliability.md): once the engine dies, every in-flight request ends with
503 `{"field": "engine"}` (streams with an `error` event, then `[DONE]`), `/health` answers 503,
and — after `ENGINE_DEATH_DRAIN_S`, so those answers reach their clients — the lifespan calls
`app.state.on_engine_death` when set: `causalboard serve` then stops and exits 1, so a
supervisor restarts it, as `vllm serve` does. Stored source runs die with the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator

from fastapi import FastAPI

from engine_ext import Engine, EngineConfig

from app.api.auth import resolve_api_key
from app.api.body_limit import install_body_limit
from app.api.compat import capture_log as capture_log_consumer
from app.api.deps import ApiSettings, engine_of, install_state, sweep_service_of
from app.api.errors import install_error_handlers
from app.api.routes import (capture, dynamic, fork_registry, generation, openai_compat, state_check, status, steering, sweep,
                            tokens)
from app.sweep.service import SweepService

logger = logging.getLogger("causalboard.api")

#: how often the lifespan checks that the engine is alive
ENGINE_WATCH_S = 0.25
#: after the engine died: time for the in-flight requests' error answers to reach their clients
#: before `app.state.on_engine_death` is called
ENGINE_DEATH_DRAIN_S = 2.0

ROUTERS = (status.router, tokens.router, openai_compat.router, generation.router, sweep.router, fork_registry.router,
           steering.router, capture.router, dynamic.router, state_check.router)


def create_app(engine: Engine | None = None, config: EngineConfig | None = None, api_key: str | None = None,
               capture_dir: str | None = None, capture_log: str | dict | None = None, dashboard: bool = True) -> FastAPI:
    """The API app on `engine` (already started; the caller closes it), or on a new engine
    built from `config` (default: the bundled model) that the lifespan starts and closes.
    `capture_dir` (else the `CAUSALBOARD_CAPTURE_DIR` environment variable) enables the fork's
    `filesystem` capture consumer, writing under that directory; `capture_log` (else
    `CAUSALBOARD_CAPTURE_LOG`), the fork's server-wide `logging` consumer's params as JSON
    (`app/api/compat/capture_log.py`). `dashboard`: mount the Panel dashboard at `/dashboard`
    (False: the API alone, without importing Panel — `causalboard serve --no-dashboard`, e.g. on a
    GPU host whose environment was made for the engine only)."""
    owns_engine = engine is None
    app = FastAPI(
        title="causalboard",
        version="0.1.0",
        summary="Causal tracing and activation steering on vLLM",
        lifespan=_lifespan(owns_engine),
    )
    engine = engine if engine is not None else Engine(config)
    settings = ApiSettings(api_key=resolve_api_key(api_key), capture_dir=capture_dir or os.environ.get("CAUSALBOARD_CAPTURE_DIR") or None,
                           capture_log=capture_log_consumer.parse(capture_log or os.environ.get("CAUSALBOARD_CAPTURE_LOG")))
    install_state(app, engine, settings, SweepService(engine))
    install_error_handlers(app)
    install_body_limit(app, settings.max_body_bytes)
    for router in ROUTERS:
        app.include_router(router)
    if dashboard:
        from app.dashboard import mount as mount_dashboard

        mount_dashboard(app)
    return app


def _lifespan(owns_engine: bool):
    """Start the engine (when the app owns it), print where the app serves (`app.state.announce`,
    set by the CLI), and on shutdown cancel running sweeps before closing the engine."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine = engine_of(app)
        if owns_engine:
            import anyio

            await anyio.to_thread.run_sync(engine.start)
        if app.state.settings.capture_log is not None:  # a layer the model lacks fails the start-up
            capture_log_consumer.setup(app.state.settings.capture_log, engine.info.num_layers)
        announce = getattr(app.state, "announce", None)
        if announce:
            print(f"causalboard: serving {engine.info.model} on {engine.info.device} at {announce}", flush=True)
        watcher = asyncio.create_task(_watch_engine(app, engine), name="causalboard-engine-watch")
        try:
            yield
        finally:
            watcher.cancel()
            await sweep_service_of(app).cancel_all()  # release leases before the engine goes
            if owns_engine:
                engine.close()

    return lifespan


async def _watch_engine(app: FastAPI, engine: Engine) -> None:
    """Wait for the engine to die; then, after the drain, call `app.state.on_engine_death`."""
    while engine.alive:
        await asyncio.sleep(ENGINE_WATCH_S)
    if engine.failure is None:  # closed on purpose (shutdown), not a failure
        return
    logger.error("the vLLM engine died (%s): every request now answers 503; stored source runs are lost", engine.failure)
    on_death = getattr(app.state, "on_engine_death", None)
    if on_death is not None:
        await asyncio.sleep(ENGINE_DEATH_DRAIN_S)
        on_death()

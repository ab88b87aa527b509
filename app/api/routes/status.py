"""Routes: liveness and server status (see app/api/routes/__init__.py).

* `GET /health` — 200 while the engine serves, 503 otherwise;
* `GET /v1/status` — model, hooks, load, source store, determinism checksum, global steering,
  named vectors, API key, sweeps. The model is reported by name: no host path of the server
  is in this answer (the API has no authenticated reads);
* `GET /v1/model/tasks` — the served model folder's `tasks.json` (example prompts with known
  answers, for the dashboard and notebooks), 404 when it has none.

They report the engine's state, so they take it running or not (`engine_handle`).
"""

from __future__ import annotations

import json

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from engine_ext import Engine
from engine_ext.sites import HOOKS

from app.api.deps import ApiSettings, engine_handle, get_settings, get_sweep_service
from app.api.errors import error_response
from app.api.schemas.generation import ErrorResponse, StatusResponse
from app.api.steering_state import active_sites
from app.sweep.service import SweepService

router = APIRouter(tags=["status"])

ERRORS = {code: {"model": ErrorResponse} for code in (400, 503)}


@router.get("/health", responses=ERRORS)
async def health(engine: Engine = Depends(engine_handle)) -> JSONResponse:
    """Liveness: 200 while the engine serves, 503 before it has started and once it has stopped."""
    if engine.alive:
        return JSONResponse({"status": "ok"})
    why = f"it stopped: {engine.failure}" if engine.failure is not None else "not started yet, or shut down"
    return error_response(503, f"engine: the vLLM engine is not running ({why})", "engine")


@router.get("/v1/status", response_model=StatusResponse, responses=ERRORS)
async def status(engine: Engine = Depends(engine_handle), settings: ApiSettings = Depends(get_settings),
                 sweeps: SweepService = Depends(get_sweep_service)) -> StatusResponse:
    """Model, layers, hooks, device, versions and load; the source-run store, the determinism
    checksum of applied interventions (per worker and compared across ranks), the global
    steering's sites, the number of named vectors and the patch-sweep service. `status` is
    'dead' once the engine has stopped; 503 before it has started (no model to describe)."""
    info = engine.info  # EngineDeadError (503) until the engine has started
    store = checksum = dynamic = None
    if engine.alive:
        def control_plane() -> tuple[dict, dict]:
            return engine.source_store_usage(), engine.intervention_status()

        store, ivs = await run_in_threadpool(control_plane)
        checksum = {**ivs["determinism"], "workers": ivs["workers"]}
        dynamic = engine.dynamic_status(ivs)
    fields = info.to_dict()
    fields.pop("model_path", None)  # a host path: never shown to callers
    return StatusResponse(
        status="ok" if engine.alive else "dead",
        **fields,
        hooks=list(HOOKS),
        in_flight_requests=engine.in_flight,
        source_store=store,
        checksum=checksum,
        global_steering=active_sites([*engine.global_steer, *engine.global_clamps]),
        named_vectors=len(engine.list_vectors()),
        api_key_required=bool(settings.api_key),
        sweeps=sweeps.status(),
        dynamic=dynamic,
    )


@router.get("/v1/model/tasks", responses={**ERRORS, 404: {"model": ErrorResponse}})
async def model_tasks(engine: Engine = Depends(engine_handle)) -> JSONResponse:
    """The served model's `tasks.json` (prompts with known answers, fact pairs for causal
    tracing; the bundled model ships one), so clients on other hosts get the examples without
    the server's filesystem path. 404 naming `model` when the model folder has none."""
    path = engine.model_path / "tasks.json"

    def read() -> dict | None:
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return None

    tasks = await run_in_threadpool(read)
    if not isinstance(tasks, dict):
        return error_response(404, f"model: the served model ({engine.info.model}) has no readable tasks.json", "model")
    return JSONResponse(tasks)

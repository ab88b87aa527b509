"""Routes: recurrent-state hygiene of hybrid models (see app/api/routes/__init__.py).

* `POST /v1/state_check` — the sentinel 4-arm check on the served hybrid model
  (`Engine.state_check`, docs/hybrid-models.md). It switches the hygiene mode of every request
  while it runs, so it needs the API key when the server has one and an idle engine. Plain
  `def`: the check blocks (FastAPI runs it in its thread pool).
"""

from __future__ import annotations

from fastapi import APIRouter, Depends

from engine_ext import Engine

from app.api.auth import UNAUTHORIZED, require_api_key
from app.api.deps import get_engine
from app.api.schemas.generation import ErrorResponse
from app.api.schemas.hybrid import StateCheckReport, StateCheckRequest

router = APIRouter(tags=["hybrid"])

ERRORS = {**{code: {"model": ErrorResponse} for code in (400, 413, 503)},
          **{code: {**v, "model": ErrorResponse} for code, v in UNAUTHORIZED.items()}}


@router.post("/v1/state_check", response_model=StateCheckReport, responses=ERRORS,
             dependencies=[Depends(require_api_key)], summary="Sentinel 4-arm recurrent-state check (hybrids)")
def state_check(req: StateCheckRequest, engine: Engine = Depends(get_engine)) -> StateCheckReport:
    """Per arm {slots zeroed, sentinel-filled} x {mask intact, forced off}: whether the probes'
    outputs changed against a clean baseline and whether the zero-on-realloc guard fired."""
    report = engine.state_check(req.probes, max_tokens=req.max_tokens, sentinel_std=req.sentinel_std, seed=req.seed)
    return StateCheckReport.model_validate(report)

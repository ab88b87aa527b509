"""Routes: dynamic steering (docs/dynamic-steering.md).

* `GET /v1/steering/probes` — registered probes; `POST` registers one (JSON);
  `DELETE /v1/steering/probes/{name}`; `POST /v1/steering/probes/fit` builds one from captures
  of two prompt sets (difference of means, least squares or logistic);
* `GET /v1/steering/dynamic/policies`, `PUT` — the global policies (every request gets them
  unless it says `use_global: false`);
* `GET /v1/steering/dynamic` — every worker's dynamic state and the applied-action checksums
  compared within each pipeline stage (`determinism`), as in the reference fork.

Per-request policies ride on `POST /v1/generate` (`dynamic`); their per-token trace comes back in
`intervention.dynamic`. Mutations need the API key when the server has one. Handlers are plain
`def`: the engine's control-plane calls block, so FastAPI runs them in its thread pool.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends

from engine_ext import Engine

from app.api.auth import UNAUTHORIZED, require_api_key
from app.api.deps import get_engine
from app.api.errors import error_response
from app.api.schemas.dynamic import (
    DynamicStatusResponse,
    PoliciesRequest,
    PoliciesResponse,
    ProbeDeleted,
    ProbeFitRequest,
    ProbeFitResponse,
    ProbeInfo,
    ProbeList,
    ProbeSpec,
)
from app.api.schemas.generation import ErrorResponse

router = APIRouter(tags=["dynamic steering"])

_ERR = {"model": ErrorResponse}
BAD = {400: {**_ERR, "description": "Invalid request; `field` names the offending field"}}
GUARDED = {**BAD, **{k: {**v, **_ERR} for k, v in UNAUTHORIZED.items()}}


@router.get("/v1/steering/probes", response_model=ProbeList, responses=BAD, summary="Registered probes")
def list_probes(eng: Engine = Depends(get_engine)) -> ProbeList:
    """Every registered probe: name, site, kind, number of scores, labels and content digest."""
    return ProbeList(probes=[ProbeInfo(**p) for p in eng.list_probes()])


@router.post("/v1/steering/probes", response_model=ProbeInfo, responses=GUARDED,
             dependencies=[Depends(require_api_key)], summary="Register (or replace) a probe")
def register_probe(req: ProbeSpec, eng: Engine = Depends(get_engine)) -> ProbeInfo:
    """A direction, a linear classifier or a bank at one site; 400 naming the field for wrong
    dimensions, non-finite values, an unknown site or a layer out of range."""
    probe = eng.register_probe(req.model_dump(exclude_none=True))
    return ProbeInfo(**probe.summary())


@router.post("/v1/steering/probes/fit", response_model=ProbeFitResponse, responses=GUARDED,
             dependencies=[Depends(require_api_key)], summary="Fit a probe from two prompt sets")
def fit_probe(req: ProbeFitRequest, eng: Engine = Depends(get_engine)) -> ProbeFitResponse:
    """Captures `site` at `positions` for every prompt of both sets and fits a probe (`method`);
    registers it under `name` unless `keep` is false. Returns the midpoint threshold and
    every training prompt's score."""
    out = eng.fit_probe(req.name, req.site, req.positive, req.negative, method=req.method, positions=req.positions,
                        l2=req.l2, register=req.keep)
    return ProbeFitResponse(probe=ProbeInfo(**out["probe"].summary()), threshold=out["threshold"],
                            positive_scores=out["positive_scores"], negative_scores=out["negative_scores"])


@router.delete("/v1/steering/probes/{name}", response_model=ProbeDeleted,
               responses={**GUARDED, 404: {**_ERR, "description": "No such probe"}},
               dependencies=[Depends(require_api_key)], summary="Delete a probe")
def delete_probe(name: str, eng: Engine = Depends(get_engine)):
    """Forget a probe on every worker (400 while a global policy uses it; 404 when unknown). A
    running request whose policy reads it is voided (its policy can no longer decide)."""
    if eng.get_probe(name) is None:
        return error_response(404, f"name: no registered probe named {name!r}", "name")
    return ProbeDeleted(name=name, deleted=eng.delete_probe(name))


@router.get("/v1/steering/dynamic/policies", response_model=PoliciesResponse, responses=BAD, summary="Global policies")
def get_policies(eng: Engine = Depends(get_engine)) -> PoliciesResponse:
    """The global policies every request gets (unless it sets `use_global: false`)."""
    return PoliciesResponse(policies=[p.to_api() for p in eng.dynamic_policies])


@router.put("/v1/steering/dynamic/policies", response_model=PoliciesResponse, responses=GUARDED,
            dependencies=[Depends(require_api_key)], summary="Replace the global policies")
def set_policies(req: PoliciesRequest, eng: Engine = Depends(get_engine)) -> PoliciesResponse:
    """Every request submitted from now on gets these policies (before its own); [] clears."""
    eng.set_dynamic_policies([p.model_dump(exclude_none=True) for p in req.policies])
    return PoliciesResponse(policies=[p.to_api() for p in eng.dynamic_policies])


@router.get("/v1/steering/dynamic", response_model=DynamicStatusResponse, responses=BAD, summary="Dynamic steering state")
def dynamic_status(eng: Engine = Depends(get_engine)) -> DynamicStatusResponse:
    """Active probes, global policies, and per worker: requests with policies, engaged requests,
    action count and checksum; `determinism` compares the checksums within each pipeline stage
    (a mismatch is logged, rate-limited, and never fails a request)."""
    return DynamicStatusResponse(**eng.dynamic_status())

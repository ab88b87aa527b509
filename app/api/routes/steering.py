"""Routes: global steering, named vectors, steering modules (see app/api/routes/__init__.py).

Wire-compatible with the reference fork where it maps onto the engine (`/v1/steering/set`,
`/clear`, `GET /v1/steering`, `/layers`, `/modules/*`), extended with native `steer` entries and
named-vector endpoints. Mutations need the API key when the server has one (`app/api/auth.py`) and
are serialised by one lock (a merge is read-modify-write). Handlers are plain `def`: the engine's
control-plane calls block, so FastAPI runs them in its thread pool.
"""

from __future__ import annotations

import threading

import numpy as np
from fastapi import APIRouter, Depends, Request

from engine_ext import Engine
from engine_ext.errors import SpecError
from engine_ext.specs import Steer, check_safe_name
from engine_ext.sites import HOOKS

from app.fork import steering_modules
from app.fork.clamps import GLOBAL_TIERS, parse_tiers
from app.api.auth import UNAUTHORIZED, require_api_key
from app.api.errors import error_response
from app.api.field_names import by_index
from app.fork.vectors import TIER_PHASES, check_vector, parse_vector_spec
from app.api.schemas.generation import ErrorResponse
from app.api.schemas.interventions import (
    ModuleEntry,
    ModuleList,
    ModuleRegisterRequest,
    ModuleResponse,
    ModuleUnregisterRequest,
    SteeringLayersResponse,
    SteeringSetRequest,
    SteeringSetResponse,
    SteeringStatusResponse,
    StatusOk,
    VectorDeleted,
    VectorInfo,
    VectorList,
    VectorRegisterRequest,
    VectorValues,
)
from app.api.steering_state import active_sites, describe, merge_steers
from app.api.vector_files import VectorFileError, decode_vector_file
from app.api.deps import get_engine

router = APIRouter(tags=["steering"])

#: largest accepted vector file (a float64 vector of 64k dimensions fits)
MAX_VECTOR_FILE_BYTES = 1024 * 1024

_ERR = {"model": ErrorResponse}
BAD = {400: {**_ERR, "description": "Invalid request; `field` names the offending field"}}
GUARDED = {**BAD, **{k: {**v, **_ERR} for k, v in UNAUTHORIZED.items()}}
NOT_FOUND = {404: {**_ERR, "description": "No such named vector / module"}}

_mutation = threading.Lock()


def _refuse_unsupported(req, fields: tuple[str, ...]) -> None:
    for f in fields:
        if getattr(req, f) is not None:
            raise SpecError(f, "is not supported by causalboard (the request is refused rather than run without it)")


def _tier_steers(req, eng: Engine) -> tuple[list[Steer], list[str]]:
    """The fork tiers of `req` as single-site Steer entries, and each one's request field."""
    info = eng.info
    steers: list[Steer] = []
    origins: list[str] = []
    for tier, phase in TIER_PHASES.items():
        for s in parse_vector_spec(getattr(req, tier), tier, phase=phase, num_layers=info.num_layers, hidden=info.hidden_size):
            steers.append(s)
            origins.append(f"{tier}.{s.sites[0].hook}.{s.sites[0].layer}")
    return steers, origins


def _norm(vec: np.ndarray) -> float:
    return float(np.linalg.norm(vec.astype(np.float64)))


def _vector_info(eng: Engine, name: str) -> VectorInfo | None:
    """Name, dimension and norm of a registered vector; None if it is gone (deleted meanwhile)."""
    vec = eng.named_vector(name)
    return None if vec is None else VectorInfo(name=name, dim=int(vec.shape[0]), norm=_norm(vec))


# ---- global steering ------------------------------------------------------------------------------
@router.post("/v1/steering/set", response_model=SteeringSetResponse, responses=GUARDED,
             dependencies=[Depends(require_api_key)], summary="Set global steering (fork-compatible)")
def set_steering(req: SteeringSetRequest, eng: Engine = Depends(get_engine)) -> SteeringSetResponse:
    """Add steering vectors to every request the server runs (composes with per-request steering).

    Fork tiers: `vectors` (prefill and decode), `prefill_vectors`, `decode_vectors`, each
    `{hook: {layer: [floats] | {"vector": [...], "scale": s}}}` or the packed
    `{hook: {"dtype", "shape", "layer_indices", "data", "scales"?}}`; and/or native `steer`
    entries. `replace: false` merges: an entry replaces the current steering at the same site
    and phase. Directional clamps: the fork tiers `clamps`, `prefill_clamps`, `decode_clamps`
    (`{hook: {layer: [{"vector", "min"?, "max"?, "strength"?} | {"vector", "value"}]}}` or the
    fork's packed forms) and/or native `clamp` entries; merged the same way (new clamps replace
    the current ones at the same site and phase). Resets the prefix cache (cached KV was
    computed under the old steering)."""
    if req.target not in (None, "main"):
        raise SpecError("target", f"{req.target!r} is not supported: causalboard serves one model (use 'main' or omit it)")
    new, origins = _tier_steers(req, eng)
    if req.steer:
        origins += [f"steer[{k}]" for k in range(len(req.steer))]
        new += [s.to_steer(f"steer[{k}]") for k, s in enumerate(req.steer)]
    info = eng.info
    new_clamps, clamp_origins = parse_tiers(req, GLOBAL_TIERS, num_layers=info.num_layers, hidden=info.hidden_size)
    if req.clamp:
        clamp_origins += [f"clamp[{k}]" for k in range(len(req.clamp))]
        new_clamps += [c.to_clamp(f"clamp[{k}]") for k, c in enumerate(req.clamp)]
    if not new and not new_clamps:
        raise SpecError("vectors", "no vectors or clamps given: set at least one of vectors, prefill_vectors, decode_vectors, "
                                   "steer, clamps, prefill_clamps, decode_clamps or clamp")
    with _mutation:
        merged = list(new) if req.replace else merge_steers(eng.global_steer, new)
        merged_clamps = list(new_clamps) if req.replace else merge_steers(eng.global_clamps, new_clamps)
        try:
            eng.set_global_steer(merged, merged_clamps)
        except SpecError as exc:
            exc = by_index(exc, "steer", origins, offset=len(merged) - len(new))
            off, n_fork = len(merged_clamps) - len(new_clamps), len(new_clamps) - len(req.clamp or ())
            exc = by_index(exc, "clamp", clamp_origins[:n_fork], offset=off,  # single-site fork entries: no `.sites[0]`
                           suffix=lambda rest: "" if rest.startswith(".sites") else rest)
            raise by_index(exc, "clamp", clamp_origins[n_fork:], offset=off + n_fork) from None
    named = [*new, *new_clamps]
    return SteeringSetResponse(
        hook_points=sorted({site.hook for s in named for site in s.sites}),
        layers_updated=sorted({site.layer for s in named for site in s.sites}),
        sites=active_sites([*merged, *merged_clamps]),
    )


@router.post("/v1/steering/clear", response_model=StatusOk, responses=GUARDED,
             dependencies=[Depends(require_api_key)], summary="Clear global steering")
def clear_steering(eng: Engine = Depends(get_engine)) -> StatusOk:
    """Remove every global steering entry and global clamp (per-request steering is unaffected);
    resets the prefix cache. Any body is ignored (the fork accepts an optional `{"target": ...}`)."""
    with _mutation:
        eng.clear_global_steer()
    return StatusOk()


@router.get("/v1/steering", response_model=SteeringStatusResponse, responses=BAD, summary="Active global steering")
def get_steering(eng: Engine = Depends(get_engine)) -> SteeringStatusResponse:
    """The fork's `active_layers` (per layer and hook: the norm of the summed both-phase vectors,
    and `prefill_norm` / `decode_norm` where phase-specific entries exist) plus the native
    entries (`steer`), which POST back to `/v1/steering/set` unchanged."""
    return SteeringStatusResponse(**describe(eng.global_steer, eng, eng.global_clamps))


@router.get("/v1/steering/layers", response_model=SteeringLayersResponse, responses=BAD, summary="Steerable layers and hooks")
def get_steering_layers(eng: Engine = Depends(get_engine)) -> SteeringLayersResponse:
    """Every layer of the model with the hooks steering, patching and capture can use."""
    n = eng.info.num_layers
    return SteeringLayersResponse(layers={str(i): {"hook_points": sorted(HOOKS)} for i in range(n)})


# ---- named vectors ----------------------------------------------------------------------------------
def _check_user_name(name: str) -> None:
    """A user's vector name: the safe name set of `keep_as` (no '/': it must read back as one
    path segment of `GET /v1/steering/vectors/{name}`); `module/...` is the modules' own."""
    if name.startswith(steering_modules.PREFIX):
        raise SpecError("name", f"names starting with {steering_modules.PREFIX!r} are reserved for steering modules")
    check_safe_name(name, "name")


@router.post("/v1/steering/vectors", response_model=VectorInfo, responses=GUARDED,
             dependencies=[Depends(require_api_key)], summary="Register a named vector (JSON)")
def register_vector(req: VectorRegisterRequest, eng: Engine = Depends(get_engine)) -> VectorInfo:
    """Register (or replace) a named steering vector, usable as `{"name": ...}` in steering
    entries and as a fork `source_module`. 400 for a wrong dimension, NaN/inf values or more
    than the engine's named-vector limit."""
    _check_user_name(req.name)
    with _mutation:
        eng.register_vector(req.name, req.vector)
        return _vector_info(eng, req.name)


@router.put(
    "/v1/steering/vectors/{name:path}", response_model=VectorInfo, dependencies=[Depends(require_api_key)],
    summary="Upload a named vector (.npy / .safetensors)",
    openapi_extra={"requestBody": {"required": True, "content": {
        "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}},
    responses={**GUARDED, 413: {**_ERR, "description": "File larger than 1 MiB"},
               415: {**_ERR, "description": "Neither .npy nor .safetensors"}},
)
async def upload_vector(name: str, request: Request, eng: Engine = Depends(get_engine)):
    """The raw body is a `.npy` file (a float array `[hidden]` or `[1, hidden]`; never
    unpickled) or a `.safetensors` file (exactly one tensor, or one named `vector`; F32, F16,
    BF16 or F64), told apart by magic bytes. At most 1 MiB."""
    from starlette.concurrency import run_in_threadpool

    _check_user_name(name)  # before reading the body: a bad name is refused whatever the file
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > MAX_VECTOR_FILE_BYTES:
        return error_response(413, f"body: a vector file may have at most {MAX_VECTOR_FILE_BYTES} bytes", "body")
    data = bytearray()
    async for chunk in request.stream():
        data += chunk
        if len(data) > MAX_VECTOR_FILE_BYTES:
            return error_response(413, f"body: a vector file may have at most {MAX_VECTOR_FILE_BYTES} bytes", "body")
    try:
        vec = decode_vector_file(bytes(data))
    except VectorFileError as exc:
        return error_response(exc.status, f"body: {exc.message}", "body")
    check_vector(vec, "body", eng.info.hidden_size)

    def register() -> VectorInfo:
        with _mutation:
            eng.register_vector(name, vec)
            return _vector_info(eng, name)

    return await run_in_threadpool(register)


@router.get("/v1/steering/vectors", response_model=VectorList, responses=BAD, summary="List named vectors")
def list_vectors(request: Request, eng: Engine = Depends(get_engine)) -> VectorList:
    """The fork's listing of its probe/steer registry (`vectors`: {"probe": [names], "steer":
    [names]}, `count`), plus causalboard's named vectors (`named`: names, dimensions and norms,
    module vectors included; `named_count`, `max_count`)."""
    from app.api.routes.fork_registry import registry_of

    reg = registry_of(request)
    infos = [i for i in (_vector_info(eng, n) for n in sorted(eng.list_vectors())) if i is not None]
    return VectorList(vectors=reg.listing(), count=reg.count(), named=infos, named_count=len(infos),
                      max_count=eng.config.limits.max_named_vectors)


@router.get("/v1/steering/vectors/{name:path}", response_model=VectorValues, responses={**BAD, **NOT_FOUND},
            summary="A named vector's values")
def get_vector(name: str, eng: Engine = Depends(get_engine)):
    """The vector's float32 values as a JSON list (404 when no vector has that name)."""
    vec = eng.named_vector(name)
    if vec is None:
        return error_response(404, f"name: no registered vector named {name!r}", "name")
    return VectorValues(name=name, dim=int(vec.shape[0]), norm=_norm(vec), vector=vec.tolist())


@router.delete("/v1/steering/vectors/{name:path}", response_model=VectorDeleted, dependencies=[Depends(require_api_key)],
               responses={**GUARDED, **NOT_FOUND, 409: {**_ERR, "description": "The global steering uses the vector"}},
               summary="Delete a named vector")
def delete_vector(name: str, eng: Engine = Depends(get_engine)):
    """404 when absent; 409 while the global steering uses it (clear that first). Requests
    already admitted that use it are voided, never silently run unsteered."""
    with _mutation:
        if name not in eng.list_vectors():
            return error_response(404, f"name: no registered vector named {name!r}", "name")
        try:
            eng.delete_vector(name)
        except SpecError as exc:
            return error_response(409, str(exc), exc.field)
    return VectorDeleted(name=name, deleted=True)


# ---- steering modules (fork) ------------------------------------------------------------------------
def _module_list(eng: Engine) -> ModuleList:
    mods = steering_modules.modules(eng)
    details = {}
    for name, entries in mods.items():
        vectors = [(site, phase, eng.named_vector(v)) for site, phase, v in entries]
        details[name] = [ModuleEntry(site=str(site), phase=phase, norm=_norm(vec)) for site, phase, vec in vectors if vec is not None]
        details[name] += [ModuleEntry(site=str(c.sites[0]), phase=c.phase, norm=_norm(c.vector), kind="clamp", min=c.min, max=c.max,
                                      strength=c.strength) for c in steering_modules.clamps_of(eng, name)]
    return ModuleList(modules=sorted(mods), count=len(mods), details=details)


@router.post("/v1/steering/modules/register", response_model=ModuleResponse, responses=GUARDED,
             dependencies=[Depends(require_api_key)], summary="Register a steering module (fork)")
def register_module(req: ModuleRegisterRequest, eng: Engine = Depends(get_engine)) -> ModuleResponse:
    """A named set of per-(hook, layer) vectors in the fork's tiers, stored as named vectors
    `module/<name>/<phase>/L<layer>.<hook>` (scales folded in). Replaces a module of the same
    name. Use it per request with `steering_name` on `/v1/completions` (its clamps act before the
    request's own, unscaled, as in the fork), or as a patch `source_module` (vectors only).
    `sae_delta` modules are not supported (400)."""
    _refuse_unsupported(req, ("sae_manifest",))
    if req.kind != "additive":
        raise SpecError("kind", f"{req.kind!r} modules are not supported by causalboard (only 'additive')")
    steering_modules.check_module_name(req.name)
    steers, _ = _tier_steers(req, eng)
    info = eng.info
    clamps, _ = parse_tiers(req, GLOBAL_TIERS, num_layers=info.num_layers, hidden=info.hidden_size)
    per_site: dict = {}
    for c in clamps:  # more than K at one site could never be applied
        key = (c.sites[0], c.phase)
        per_site[key] = per_site.get(key, 0) + 1
        both = per_site.get((c.sites[0], "both"), 0)
        if per_site[key] + (both if c.phase != "both" else 0) > eng.config.limits.max_clamp_directions:
            tier = {"both": "clamps", "prefill": "prefill_clamps", "decode": "decode_clamps"}[c.phase]
            raise SpecError(f"{tier}.{c.sites[0].hook}.{c.sites[0].layer}",
                            f"more than {eng.config.limits.max_clamp_directions} clamps at {c.sites[0]} (max_clamp_directions)")
    with _mutation:
        steering_modules.register(eng, req.name, steers, clamps)
        names = sorted(steering_modules.modules(eng))
    return ModuleResponse(name=req.name, modules=names)


@router.post("/v1/steering/modules/unregister", response_model=ModuleResponse, responses={**GUARDED, **NOT_FOUND},
             dependencies=[Depends(require_api_key)], summary="Unregister a steering module (fork)")
def unregister_module(req: ModuleUnregisterRequest, eng: Engine = Depends(get_engine)):
    """Delete every vector of the module; 404 when there is no such module."""
    with _mutation:
        try:
            found = steering_modules.unregister(eng, req.name)
        except SpecError as exc:
            return error_response(409, str(exc), exc.field)
        names = sorted(steering_modules.modules(eng))
    if not found:
        return error_response(404, f"name: steering module {req.name!r} not found (available: {', '.join(names) or 'none'})", "name")
    return ModuleResponse(name=req.name, modules=names)


@router.get("/v1/steering/modules", response_model=ModuleList, responses=BAD, summary="List steering modules (fork)")
def list_modules(eng: Engine = Depends(get_engine)) -> ModuleList:
    """`{"modules": [names], "count": n}` as in the fork, plus each module's sites and norms."""
    return _module_list(eng)


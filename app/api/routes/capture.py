"""Routes: capture runs and stored source runs (see app/api/routes/__init__.py).

* `POST /v1/capture` — run a prompt (one generated token) recording sites x prompt positions;
  JSON, or a binary body (`npz` / `safetensors`: one float32 array `[positions, hidden]` per site,
  keyed by the site text, plus `positions` and `prompt_token_ids`; the rest in `X-Causalboard-*`
  headers). `keep_as` also stores the run for patching (needs the API key when one is set).
* `GET /v1/patch_source` — the source-run store: budget, bytes used, runs and their leases.
* `DELETE /v1/patch_source/{run_id}` — drop a stored run, even a leased one (fork semantics).
"""

from __future__ import annotations

import io
import json

import numpy as np
from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from engine_ext import Engine, GenerationParams
from engine_ext.errors import SpecError
from engine_ext.specs import Interventions

from app.api.auth import UNAUTHORIZED, ApiKeyGuard, api_key_guard, require_api_key
from app.api.errors import error_response
from app.api.field_names import by_prefix
from app.api.schemas.generation import ErrorResponse
from app.api.schemas.interventions import CaptureRequest, CaptureResponse, SourceDropped, SourceStoreUsage, engine_positions
from app.api.deps import get_engine

router = APIRouter(tags=["capture"])

#: largest capture returned as JSON (floats); larger ones must use a binary format
MAX_JSON_FLOATS = 2_000_000
#: largest capture returned at all (floats: 128 MiB of float32)
MAX_BINARY_FLOATS = 32 * 1024 * 1024

_ERR = {"model": ErrorResponse}
MEDIA = {"npz": "application/x-npz", "safetensors": "application/octet-stream"}


@router.post(
    "/v1/capture", response_model=CaptureResponse, summary="Capture activations",
    responses={
        200: {"description": "JSON, or the npz / safetensors file when format says so",
              "content": {"application/x-npz": {}, "application/octet-stream": {}}},
        400: {**_ERR, "description": "Invalid request; `field` names the offending field"},
        **{k: {**v, **_ERR} for k, v in UNAUTHORIZED.items()},
        413: {**_ERR, "description": "Too many values for JSON (field `format`) or at all (field `sites`)"},
        503: {**_ERR, "description": "The capture was voided (step capacity exceeded)"},
        507: {**_ERR, "description": "keep_as: the run does not fit the source store"},
    },
)
async def capture(req: CaptureRequest, eng: Engine = Depends(get_engine), guard: ApiKeyGuard = Depends(api_key_guard)):
    """Record the residual stream at `sites` x `positions` of `prompt` (positions are prompt
    positions: `last_prompt`, `all_prompt`, indices, spans). With `keep_as`, the run is also
    stored on the workers as a patch source (`{"run": keep_as}` in patches and sweeps)."""
    if req.keep_as is not None:
        guard.check()
    try:
        spec = Interventions(capture=req.to_capture("capture"))
        positions = eng.resolve_positions(req.prompt, engine_positions(req.positions), "positions")
    except SpecError as exc:
        raise by_prefix(exc, {"capture": ""}) from None
    if not positions:
        raise SpecError("positions", "selects no prompt position (a capture records prompt positions)")
    sites = list(spec.capture.sites)
    n_values = len(sites) * len(positions) * eng.info.hidden_size if req.return_values else 0
    if n_values > MAX_BINARY_FLOATS:
        return error_response(413, f"sites: the capture has {n_values} values; at most {MAX_BINARY_FLOATS} per request "
                                   "(capture fewer sites or positions)", "sites")
    if req.format == "json" and n_values > MAX_JSON_FLOATS:
        return error_response(413, f"format: the capture has {n_values} values; JSON responses hold at most "
                                   f"{MAX_JSON_FLOATS} (ask for format 'npz' or 'safetensors')", "format")
    try:
        gen = await eng.agenerate(req.prompt, GenerationParams(max_tokens=1), spec)
    except SpecError as exc:  # raised before admission (prompt, positions, sites)
        raise by_prefix(exc, {"capture": ""}) from None
    iv = gen.intervention
    if iv is None or iv.voided:
        reasons = "; ".join(iv.errors) if iv else "the workers reported no result"
        return error_response(503, f"the capture was voided: {reasons}")
    if req.keep_as is not None and iv.stored_as != req.keep_as:
        return error_response(507, f"keep_as: the run was not stored: {'; '.join(iv.errors) or 'no room'}", "keep_as")
    arrays: dict[str, np.ndarray] = {}
    if req.return_values:
        for site in sites:
            missing = [p for p in positions if (site.layer, site.hook, p) not in iv.captures]
            if missing:
                return error_response(500, f"the engine returned no value for {site} at positions {missing}")
            arrays[str(site)] = np.stack([iv.captures[(site.layer, site.hook, p)] for p in positions]).astype(np.float32)
    meta = {"prompt_token_ids": gen.prompt_token_ids, "token_strings": eng.token_strings(gen.prompt_token_ids),
            "positions": positions, "sites": [str(s) for s in sites], "stored_as": iv.stored_as,
            "program_hash": iv.program_hash}
    if req.format == "json":
        return JSONResponse({**meta, "captures": {k: v.tolist() for k, v in arrays.items()}})
    body = await run_in_threadpool(_encode_binary, req.format, arrays, meta)
    return Response(body, media_type=MEDIA[req.format], headers={
        **_meta_headers(meta), "Content-Disposition": f'attachment; filename="capture.{req.format}"'})


def _encode_binary(fmt: str, arrays: dict[str, np.ndarray], meta: dict) -> bytes:
    tensors = {**arrays, "positions": np.asarray(meta["positions"], np.int64),
               "prompt_token_ids": np.asarray(meta["prompt_token_ids"], np.int64)}
    if fmt == "npz":
        buf = io.BytesIO()
        np.savez(buf, **tensors)
        return buf.getvalue()
    from safetensors.numpy import save

    text_meta = {"sites": json.dumps(meta["sites"]), "token_strings": json.dumps(meta["token_strings"]),
                 "stored_as": meta["stored_as"] or "", "program_hash": meta["program_hash"] or ""}
    return save({k: np.ascontiguousarray(v) for k, v in tensors.items()}, metadata=text_meta)


def _meta_headers(meta: dict) -> dict[str, str]:
    """Capture metadata as ASCII headers (JSON strings are ASCII-escaped)."""
    return {
        "X-Causalboard-Sites": ",".join(meta["sites"]),
        "X-Causalboard-Positions": ",".join(map(str, meta["positions"])),
        "X-Causalboard-Prompt-Token-Ids": ",".join(map(str, meta["prompt_token_ids"])),
        "X-Causalboard-Token-Strings": json.dumps(meta["token_strings"], ensure_ascii=True),
        "X-Causalboard-Stored-As": meta["stored_as"] or "",
        "X-Causalboard-Program-Hash": meta["program_hash"] or "",
    }


@router.get("/v1/patch_source", response_model=SourceStoreUsage, summary="Source-run store usage",
            responses={400: {**_ERR, "description": "Invalid request"}, 503: {**_ERR, "description": "The engine has stopped"}})
def store_usage(eng: Engine = Depends(get_engine)) -> SourceStoreUsage:
    """Byte budget, bytes used, evictions so far, and every stored run with its size and leases
    (first worker's view; all workers store the same runs)."""
    return SourceStoreUsage(**eng.source_store_usage())


@router.delete("/v1/patch_source/{run_id}", response_model=SourceDropped, dependencies=[Depends(require_api_key)],
               summary="Drop a stored source run",
               responses={**{k: {**v, **_ERR} for k, v in UNAUTHORIZED.items()},
                          404: {**_ERR, "description": "No worker held the run"}})
def drop_source(run_id: str, eng: Engine = Depends(get_engine)):
    """`200 {"dropped": true}`; `404` when no worker held it. Drops even a leased run (requests
    already admitted keep their copies of its values)."""
    if eng.drop_source(run_id):
        return SourceDropped(run_id=run_id)
    return error_response(404, f"run_id: no stored source run {run_id!r}", "run_id")

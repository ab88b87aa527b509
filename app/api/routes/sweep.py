"""Routes: patch sweeps.

* `POST /v1/patch_sweep` — run a sweep (JSON summary, or SSE with `stream: true`);
* `GET /v1/patch_sweep/{sweep_id}` — the summary of a recent sweep (or its state while running);
* `GET /v1/patch_sweep/{sweep_id}/events` — replay a recent/running sweep's SSE stream after
  the `Last-Event-ID` header (resume);
* `DELETE /v1/patch_sweep/{sweep_id}` — cancel a running sweep.

Bodies are the models of `app/sweep/schema.py`: `SweepSummary`, `SweepStatus`, and one
`SweepEvent` per SSE `data:` line (documented as the `text/event-stream` schema).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, Header, Request
from fastapi.responses import JSONResponse, StreamingResponse

from app.api.auth import require_api_key
from app.api.errors import error_response
from app.api.schemas.generation import ErrorResponse
from app.api.sse import DONE, sse_event
from app.sweep.plan import PlanError
from app.sweep.schema import PatchSweepRequest, SweepStatus, SweepSummary, event_json_schema
from app.sweep.service import SweepRun, SweepService

router = APIRouter(tags=["patching"])

_ERRORS = {s: {"model": ErrorResponse} for s in (400, 401, 404, 413, 503, 507)}
#: the stream: `id: <n>` + `data: <one SweepEvent>` per event, then `data: [DONE]`
_EVENT_STREAM = {"text/event-stream": {"schema": event_json_schema()}}
_SUMMARY_OR_SSE = {"content": _EVENT_STREAM, "description": "The summary (JSON), or server-sent events when stream=true"}
_SSE = {"content": _EVENT_STREAM, "description": "Server-sent events: `id: <n>` and `data: <event>` each, then `data: [DONE]`"}


def sweep_service(request: Request) -> SweepService:
    """The app's sweep service (created by `create_app`)."""
    return request.app.state.sweep_service


async def _sse(run: SweepRun, after: int, cancel_on_disconnect: bool) -> AsyncIterator[str]:
    try:
        async for event_id, event in run.follow(after):
            yield sse_event(event, event_id)
        yield DONE
    finally:
        # the client went away (or the stream ended): a POST stream owns its sweep
        if cancel_on_disconnect and not run.finished:
            run.cancel()


@router.post("/v1/patch_sweep", response_model=SweepSummary, responses={**_ERRORS, 200: _SUMMARY_OR_SSE},
             dependencies=[Depends(require_api_key)])
async def patch_sweep(req: PatchSweepRequest, request: Request):
    """Activation-patching sweep over layers x positions (x hooks): one request per cell,
    patched from the clean run (auto-captured from `clean_prompt`, or a stored `source_run`),
    an ablation source (`source_module`) or noise-corrupted input (`noise`), scored exactly on
    the answer/foil tokens. Wire format of the reference fork (see docs/api.md); errors before
    the first event are JSON with a 4xx status. Closing the stream cancels the remaining cells."""
    service = sweep_service(request)
    try:
        run = await service.start(req)
    except PlanError as exc:
        return error_response(exc.status, str(exc), exc.field)
    if req.stream:
        return StreamingResponse(_sse(run, -1, cancel_on_disconnect=True), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Sweep-Id": run.sweep_id})
    try:
        await run.task
    finally:
        run.cancel()
    return JSONResponse(run.summary.model_dump(mode="json"))


@router.get("/v1/patch_sweep/{sweep_id}", response_model=SweepSummary | SweepStatus, responses=_ERRORS)
async def sweep_summary(sweep_id: str, request: Request):
    """The summary of a finished sweep (`SweepSummary`), or its state while it runs (`SweepStatus`)."""
    run = sweep_service(request).get(sweep_id)
    if run is None:
        return error_response(404, f"sweep_id: no recent sweep {sweep_id!r}", "sweep_id")
    return JSONResponse((run.summary if run.summary is not None else run.status()).model_dump(mode="json"))


@router.get("/v1/patch_sweep/{sweep_id}/events", response_class=StreamingResponse, responses={**_ERRORS, 200: _SSE})
async def sweep_events(sweep_id: str, request: Request, last_event_id: str | None = Header(None)):
    """Replay a recent or running sweep's events after `Last-Event-ID` (all of them when
    absent), then follow it live. Disconnecting here does not cancel the sweep."""
    run = sweep_service(request).get(sweep_id)
    if run is None:
        return error_response(404, f"sweep_id: no recent sweep {sweep_id!r}", "sweep_id")
    after = -1
    if last_event_id is not None:
        if not last_event_id.strip().lstrip("-").isdigit():
            return error_response(400, "last-event-id: must be an event id (integer)", "last-event-id")
        after = int(last_event_id)
    return StreamingResponse(_sse(run, after, cancel_on_disconnect=False), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


@router.delete("/v1/patch_sweep/{sweep_id}", responses=_ERRORS, dependencies=[Depends(require_api_key)])
async def cancel_sweep(sweep_id: str, request: Request):
    """Cancel a running sweep (its summary then says `cancelled: true`)."""
    run = sweep_service(request).get(sweep_id)
    if run is None:
        return error_response(404, f"sweep_id: no recent sweep {sweep_id!r}", "sweep_id")
    was_running = not run.finished
    run.cancel()
    return {"cancelled": was_running, "state": run.state}

"""Routes: generation (see app/api/routes/__init__.py).

* `POST /v1/generate` — causalboard's native generation, with per-request `interventions`;
  JSON, or server-sent events with `stream: true`;
* `POST /v1/completions` — OpenAI-compatible text completion with the reference fork's
  per-request fields (`app/api/compat/completions.py`) and the native `interventions`.

Every request is checked in full (`Engine.validate`) before a response starts, so a bad request
is a JSON 4xx even when it asked for a stream.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends
from fastapi.responses import StreamingResponse

from engine_ext import Engine, Generation
from engine_ext.errors import EngineDeadError, SpecError

from app.api.auth import UNAUTHORIZED, ApiKeyGuard, api_key_guard
from app.api.compat import completions as completion_extras
from app.api.deps import get_engine
from app.api.errors import error_response
from app.api.field_names import by_prefix
from app.api.schemas.generation import CompletionRequest, ErrorResponse, GenerateRequest, GenerateResponse
from app.api.sse import DONE, sse_event

router = APIRouter(tags=["generation"])

ERRORS = {**{code: {"model": ErrorResponse} for code in (400, 404, 413, 503)},
          401: {"model": ErrorResponse, **UNAUTHORIZED[401]}}
#: engine field names of a native spec -> the request field that holds it
NATIVE_FIELDS = {k: f"interventions.{k}" for k in ("steer", "patch", "capture", "noise", "score_token_ids")}
SSE_HEADERS = {"Cache-Control": "no-cache"}


@router.post(
    "/v1/generate",
    response_model=GenerateResponse,
    responses={**ERRORS, 200: {"content": {"text/event-stream": {}}, "description": "JSON, or SSE when stream=true"}},
)
async def generate(req: GenerateRequest, engine: Engine = Depends(get_engine),
                   guard: ApiKeyGuard = Depends(api_key_guard)):
    """Generate from a prompt, optionally with per-request `interventions` (steer, patch,
    capture, noise, score_token_ids); the result then carries `intervention` (status, errors,
    captures, stored_as, program_hash) and `scores`. With `stream: true`, server-sent events:
    `start` (prompt token ids), one `token` event per engine step, `done` (the whole result),
    then `data: [DONE]`. Bad requests are refused with a JSON 400 before any event."""
    params = req.params()
    spec = None
    if req.interventions is not None:
        if req.interventions.keeps_source():
            guard.check()
        spec = req.interventions.to_spec("interventions")
    dynamic = req.dynamic.to_engine() if req.dynamic is not None else None
    try:
        prompt_ids = engine.validate(req.prompt, params, spec, dynamic=dynamic)
    except SpecError as exc:
        raise by_prefix(exc, NATIVE_FIELDS) from None
    if not req.stream:
        gen = await engine.agenerate(req.prompt, params, spec, dynamic=dynamic)
        return GenerateResponse(**_generation_body(gen, req.prompt))

    async def events() -> AsyncIterator[str]:
        n = 0
        gen = Generation("", req.prompt, prompt_ids)
        yield sse_event({"type": "start", "prompt_token_ids": prompt_ids}, n)
        try:
            async for delta in engine.astream(req.prompt, params, spec, dynamic=dynamic):
                gen.extend(delta)
                n += 1
                yield sse_event({"type": "token", "token_ids": delta.token_ids, "text": delta.text, "logprobs": delta.logprobs}, n)
        except Exception as exc:  # engine failure mid-stream: tell the client, don't hang
            yield sse_event({"type": "error", **_stream_error(exc)}, n + 1)
            yield DONE
            return
        yield sse_event({"type": "done", **_generation_body(gen, req.prompt)}, n + 1)
        yield DONE

    return StreamingResponse(events(), media_type="text/event-stream", headers=SSE_HEADERS)


@router.post("/v1/completions", responses=ERRORS)
async def completions(req: CompletionRequest, engine: Engine = Depends(get_engine),
                      guard: ApiKeyGuard = Depends(api_key_guard)):
    """OpenAI-compatible text completion (n = 1), streaming or not, with the reference fork's
    per-request fields (`steering_vectors` and its phase variants, `steering_name`, `patch` +
    `patch_vectors`, `logprob_token_ids`, `capture: {"patch_source": ...}`) and the native
    `interventions`. With interventions the body also carries `intervention`; with scored ids
    each choice carries `scores`. Fork fields causalboard cannot honour are refused (400)."""
    info = engine.info
    if req.model is not None and req.model not in (info.model, info.model_path):
        return error_response(404, f"model: '{req.model}' is not served here (serving '{info.model}')", "model")
    params = req.params()
    extras = completion_extras.build(req, engine)
    if extras.keeps_source():
        guard.check()
    spec = None if extras.spec.is_empty() else extras.spec
    try:
        engine.validate(req.prompt, params, spec)
    except SpecError as exc:
        raise extras.relabel(exc) from None
    scored = bool(extras.spec.score_token_ids)
    want_logprobs = req.logprobs is not None or scored
    created = int(time.time())
    cid = f"cmpl-{time.time_ns():x}"

    def choice_of(part, finished: bool) -> dict:
        tops = part.scores if scored else part.top_logprobs
        choice = {
            "index": 0,
            "text": part.text,
            "logprobs": _openai_logprobs(engine, part.token_ids, part.logprobs, tops) if want_logprobs else None,
            "finish_reason": part.finish_reason if finished else None,
        }
        if scored:
            choice["scores"] = [{str(k): v for k, v in t.items()} for t in part.scores]
        return choice

    def intervention_fields(gen: Generation) -> dict:
        out: dict = {}
        if extras.requested:
            out["intervention"] = gen.to_dict().get("intervention")
        if extras.fork_capture_run is not None:
            iv = gen.intervention
            ok = iv is not None and iv.stored_as == extras.fork_capture_run
            out["capture_results"] = {"patch_source": {"status": "ok" if ok else "error",
                                                       "error": None if ok else "; ".join(iv.errors if iv else ["no result"])}}
        return out

    if not req.stream:
        gen = await engine.agenerate(req.prompt, params, spec)
        usage = {
            "prompt_tokens": len(gen.prompt_token_ids),
            "completion_tokens": len(gen.token_ids),
            "total_tokens": len(gen.prompt_token_ids) + len(gen.token_ids),
        }
        return {"id": cid, "object": "text_completion", "created": created, "model": info.model,
                "choices": [choice_of(gen, True)], "usage": usage, **intervention_fields(gen)}

    async def events() -> AsyncIterator[str]:
        gen = Generation(cid, req.prompt, [])
        try:
            async for d in engine.astream(req.prompt, params, spec):
                gen.extend(d)
                chunk = {"id": cid, "object": "text_completion", "created": created, "model": info.model,
                         "choices": [choice_of(d, d.finished)]}
                if d.finished:
                    chunk.update(intervention_fields(gen))
                yield sse_event(chunk)
        except Exception as exc:  # engine failure mid-stream: tell the client, don't hang
            yield sse_event(_stream_error(exc))
        yield DONE

    return StreamingResponse(events(), media_type="text/event-stream", headers=SSE_HEADERS)


def _stream_error(exc: Exception) -> dict:
    """The error of a stream that failed after its first event (the engine died): the API's
    error shape (`field: engine` for an engine failure)."""
    if isinstance(exc, EngineDeadError):
        return {"error": f"engine: {exc}", "field": "engine"}
    return {"error": f"{type(exc).__name__}: {exc}", "field": None}


def _generation_body(gen: Generation, prompt: str) -> dict:
    body = gen.to_dict()
    body["prompt"] = prompt
    return body


def _openai_logprobs(engine: Engine, ids: list[int], lps: list[float], tops: list[dict[int, float]]) -> dict:
    strings = engine.token_strings(ids)
    top = [{engine.token_strings([t])[0]: v for t, v in d.items()} for d in tops] if tops else None
    return {"tokens": strings, "token_logprobs": lps, "top_logprobs": top}

"""Routes: generation (see app/api/routes/__init__.py).

* `POST /v1/generate` — causalboard's native generation, with per-request `interventions`;
  JSON, or server-sent events with `stream: true`;
* `POST /v1/completions` — OpenAI-compatible text completion with the reference fork's
  per-request fields (`app/api/compat/completions.py`) and the native `interventions`.

Every request is checked in full (`Engine.validate`) before a response starts, so a bad request
is a JSON 4xx even when it asked for a stream.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator

import anyio
from fastapi import APIRouter, Depends, Request
from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse, StreamingResponse

from engine_ext import Engine, Generation
from engine_ext.dynamic.specs import DynamicRequest
from engine_ext.errors import EngineDeadError, SpecError

from app.api.auth import UNAUTHORIZED, ApiKeyGuard, CompletionAccess, api_key_guard, completion_access
from app.api.compat import capture_files, capture_log
from app.api.compat import completions as completion_extras
from app.api.compat import gates as gate_compat
from app.api.deps import ApiSettings, get_engine
from app.api.errors import error_response
from app.api.routes.fork_registry import registry_of_state
from app.api.field_names import by_prefix
from app.api.schemas.generation import CompletionRequest, ErrorResponse, GenerateRequest, GenerateResponse
from app.api.sse import DONE, sse_event

router = APIRouter(tags=["generation"])

ERRORS = {**{code: {"model": ErrorResponse} for code in (400, 404, 413, 503)},
          401: {"model": ErrorResponse, **UNAUTHORIZED[401]}}
#: engine field names of a native spec -> the request field that holds it
NATIVE_FIELDS = {k: f"interventions.{k}" for k in ("steer", "patch", "capture", "noise", "score_token_ids", "clamp")}
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
async def completions(req: CompletionRequest, request: Request, access: CompletionAccess = Depends(completion_access)):
    """OpenAI-compatible text completion, streaming or not, with the reference fork's per-request
    fields (`steering_vectors` and its phase variants, `steering_name`, `patch` + `patch_vectors`,
    `logprob_token_ids`, `capture: {"patch_source": ...}`, `cache_salt`, `conversation_id`, the
    declarative `steering` gates) and the native `interventions`. `prompt` may be text, token ids, or a list of either (one choice
    per prompt). With interventions the body of a single-prompt request also carries
    `intervention`; with scored ids each choice carries `scores`. Fork fields causalboard cannot honour are refused (400)."""
    return await run_completion(req, access.engine, access.guard, CompletionShape(), access.settings, request)


class CompletionShape:
    """How a completion is written on the wire: OpenAI's `text_completion` (this class) or
    `chat.completion` (`app/api/routes/openai_compat.py`)."""

    object = "text_completion"
    chunk_object = "text_completion"
    id_prefix = "cmpl"

    def logprobs(self, engine: Engine, ids: list[int], lps: list[float], tops: list[dict[int, float]] | None) -> dict:
        return _openai_logprobs(engine, ids, lps, tops)

    def choice(self, index: int, text: str, logprobs: dict | None, finish_reason: str | None) -> dict:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    def delta_choice(self, index: int, text: str, logprobs: dict | None, finish_reason: str | None, first: bool) -> dict:
        return self.choice(index, text, logprobs, finish_reason)


async def run_completion(req: CompletionRequest, engine: Engine, guard: ApiKeyGuard, shape: CompletionShape,
                         settings: ApiSettings, request: Request):
    """One completion request (any number of prompts) in `shape`'s wire form (`settings`: the
    fork's filesystem capture directory and server-wide logging consumer; `request`: the HTTP
    request, whose app holds the fork's vector registry and the gates' conversation latches)."""
    info = engine.info
    if req.model is not None and req.model not in (info.model, info.model_path):
        return error_response(404, f"model: '{req.model}' is not served here (serving '{info.model}')", "model")
    prompts, single = req.prompts()
    if not prompts:
        raise SpecError("prompt", "must hold at least one prompt")
    created = int(time.time())
    cid = f"{shape.id_prefix}-{time.time_ns():x}"
    params = req.params()
    capture_dir, log = settings.capture_dir, settings.capture_log
    registry = registry_of_state(request.app.state)
    latches = gate_compat.latches_of(request.app.state)
    extras = completion_extras.build(req, engine, default_run=cid, capture_dir=capture_dir, resolve=registry.resolve)
    if extras.keeps_source() or extras.file_capture is not None:
        guard.check()  # a stored run, or files on the server
    if extras.fork_capture:
        if len(prompts) > 1:
            raise SpecError("capture.patch_source.run", "one stored run per request: give a single prompt with a capture")
    # the fork's server-wide logging consumer captures every completion without a capture of its own
    logged_spec, log_added = capture_log.with_capture(extras.spec, log, info.num_layers)
    spec = None if logged_spec.is_empty() else logged_spec
    # the fork's conversation_id: the conversation of the server's global dynamic-steering
    # policies (`latch: conversation`), as its dynamic-steering consumers read it
    dynamic = None
    if req.conversation_id is not None:
        try:
            dynamic = DynamicRequest.make([], req.conversation_id, True)
        except SpecError as exc:
            raise SpecError("conversation_id", exc.message) from None
    # the fork's declarative gates (and a latched conversation's bridge) run as dynamic steering
    gates = gate_compat.gate_set(extras.gates, extras.static_decode, req.conversation_id, registry, latches)
    if gates is not None:
        dynamic = dataclasses.replace(dynamic or DynamicRequest(), gates=gates)
    # every prompt is checked before any runs; a single prompt answered in one body is checked by
    # its own `agenerate` instead (the same check, once: the same error, relabelled below)
    for k, prompt in enumerate(prompts if req.stream or not single else ()):
        try:
            engine.validate(prompt, params, spec, dynamic=dynamic)
        except SpecError as exc:
            exc = extras.relabel(exc)
            if not single and exc.field == "prompt":
                exc = SpecError(f"prompt[{k}]", exc.message)
            raise exc from None
    scored = bool(extras.spec.score_token_ids)
    want_logprobs = req.logprobs is not None or scored

    def logprobs_of(part) -> dict | None:
        if not want_logprobs:
            return None
        return shape.logprobs(engine, part.token_ids, part.logprobs, part.scores if scored else part.top_logprobs)

    def with_scores(choice: dict, part) -> dict:
        if scored:
            choice["scores"] = [{str(k): v for k, v in t.items()} for t in part.scores]
        return choice

    def intervention_fields(gen: Generation) -> dict:
        out: dict = {}
        if extras.requested:
            out["intervention"] = gen.to_dict().get("intervention")
            if log_added and out["intervention"] is not None:
                out["intervention"]["captures"] = []  # the logging consumer's values are not the client's
        if extras.fork_capture_run is not None:
            iv = gen.intervention
            ok = iv is not None and iv.stored_as == extras.fork_capture_run
            payload = {"run": extras.fork_capture_run}
            if ok:
                cap = extras.spec.capture
                payload.update(sites=[str(s) for s in cap.sites], num_prompt_tokens=len(gen.prompt_token_ids))
            out.setdefault("capture_results", {})["patch_source"] = {
                "status": "ok" if ok else "error", "error": None if ok else "; ".join(iv.errors if iv else ["no result"]),
                "payload": payload}
        if extras.file_capture is not None:
            out.setdefault("capture_results", {})["filesystem"] = file_results.get(id(gen)) or {
                "status": "error", "error": "the capture did not complete", "payload": {}}
        return out

    file_results: dict[int, dict] = {}

    async def write_files(gen: Generation) -> None:
        """The fork's filesystem consumer: the captured values as files (before the response)."""
        fc = extras.file_capture
        iv = gen.intervention
        if iv is None or iv.voided:
            file_results[id(gen)] = {"status": "error", "error": "; ".join(iv.errors if iv else ["no result"]), "payload": {}}
            return
        try:
            paths = await anyio.to_thread.run_sync(capture_files.write, capture_dir, fc, iv.captures, cid)
            file_results[id(gen)] = {"status": "ok", "error": None, "payload": {"paths": paths}}
        except OSError as exc:
            file_results[id(gen)] = {"status": "error", "error": f"writing the capture failed: {exc}", "payload": {}}

    def finished(gen: Generation, k: int) -> None:
        """A finished prompt: the conversation's gate latch, the logging consumer's lines."""
        gate_compat.record(gen, req.conversation_id, latches)
        if log is not None:
            capture_log.write(gen, cid if single else f"{cid}-{k}", log, log_added, info.num_layers)

    def common() -> dict:
        out = {"id": cid, "object": shape.object, "created": created, "model": info.model}
        if req.conversation_id is not None:
            out["conversation_id"] = req.conversation_id
        return out

    if not req.stream:
        try:
            if single:  # awaited in place: no task for gather to make
                gens = [await engine.agenerate(prompts[0], params, spec, dynamic=dynamic)]
            else:
                gens = await asyncio.gather(*(engine.agenerate(p, params, spec, dynamic=dynamic) for p in prompts))
        except SpecError as exc:
            raise extras.relabel(exc) from None
        for k, g in enumerate(gens):
            finished(g, k)
        if extras.file_capture is not None:
            await write_files(gens[0])
        n_prompt = sum(len(g.prompt_token_ids) for g in gens)
        n_gen = sum(len(g.token_ids) for g in gens)
        usage = {"prompt_tokens": n_prompt, "completion_tokens": n_gen, "total_tokens": n_prompt + n_gen}
        choices = [with_scores(shape.choice(k, g.text, logprobs_of(g), g.finish_reason), g) for k, g in enumerate(gens)]
        body = {**common(), "choices": choices, "usage": usage}
        if single:
            body.update(intervention_fields(gens[0]))
        return plain_json(body)

    async def events() -> AsyncIterator[str]:
        try:
            for k, prompt in enumerate(prompts):
                gen = Generation(cid, prompt if isinstance(prompt, str) else None, [])
                first = True
                async for d in engine.astream(prompt, params, spec, dynamic=dynamic):
                    gen.extend(d)
                    choice = shape.delta_choice(k, d.text, logprobs_of(d), d.finish_reason if d.finished else None, first)
                    first = False
                    chunk = {**common(), "object": shape.chunk_object, "choices": [with_scores(choice, d)]}
                    if d.finished:
                        finished(gen, k)
                    if d.finished and single:
                        if extras.file_capture is not None:
                            await write_files(gen)
                        chunk.update(intervention_fields(gen))
                    yield sse_event(chunk)
        except Exception as exc:  # engine failure mid-stream: tell the client, don't hang
            yield sse_event(_stream_error(exc))
        yield DONE

    return StreamingResponse(events(), media_type="text/event-stream", headers=SSE_HEADERS)


def plain_json(body: dict) -> JSONResponse:
    """`body` answered as JSON straight away: a completion's body is plain data (str, int, float,
    lists, dicts), for which FastAPI's `jsonable_encoder` walk (what a returned dict gets) costs
    more than the encoding itself; a body holding anything else still goes through it."""
    try:
        return JSONResponse(body)
    except TypeError:
        return JSONResponse(jsonable_encoder(body))


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

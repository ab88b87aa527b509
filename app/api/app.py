"""The causalboard HTTP API (FastAPI). Start it with `causalboard serve` (or `make run`).

`create_app(engine)` serves an already started `Engine` (tests share one engine per session);
`create_app(config=EngineConfig(...))` starts and stops its own engine in the app's lifespan.
`api_key` (else the `CAUSALBOARD_API_KEY` environment variable) guards mutating endpoints
(`app/api/auth.py`).
"""

from __future__ import annotations

import contextlib
import inspect
import time
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from engine_ext import Engine, EngineConfig, Generation
from engine_ext.errors import SpecError
from engine_ext.sites import HOOKS

from app.api.compat import completions as completion_extras
from app.api.auth import UNAUTHORIZED, check_api_key, install_auth
from app.api.errors import error_response, install_error_handlers
from app.api.field_names import by_prefix
from app.api.routes import capture as capture_routes
from app.api.routes import steering as steering_routes
from app.api.routes import sweep as sweep_routes
from app.api.steering_state import active_sites
from app.api.schemas.generation import (
    CompletionRequest,
    ErrorResponse,
    GenerateRequest,
    GenerateResponse,
    StatusResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from app.api.sse import DONE, sse_event
from app.sweep.service import SweepService

MAX_BODY_BYTES = 8 * 1024 * 1024
ERRORS = {400: {"model": ErrorResponse}, 404: {"model": ErrorResponse}, 413: {"model": ErrorResponse}, 503: {"model": ErrorResponse}}
GEN_ERRORS = {**ERRORS, 401: {"model": ErrorResponse, **UNAUTHORIZED[401]}}
#: engine field names of a native spec -> the request field that holds it
NATIVE_FIELDS = {k: f"interventions.{k}" for k in ("steer", "patch", "capture", "noise", "score_token_ids")}


def create_app(engine: Engine | None = None, config: EngineConfig | None = None, api_key: str | None = None) -> FastAPI:
    owns_engine = engine is None

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        eng = app.state.engine
        if owns_engine:
            import anyio

            await anyio.to_thread.run_sync(eng.start)
        announce = getattr(app.state, "announce", None)
        if announce:
            print(f"causalboard: serving {eng.info.model} on {eng.info.device} at {announce}", flush=True)
        try:
            yield
        finally:
            await app.state.sweep_service.cancel_all()  # release leases before the engine goes
            if owns_engine:
                eng.close()

    app = FastAPI(
        title="causalboard",
        version="0.1.0",
        summary="Causal tracing and activation steering on vLLM",
        lifespan=lifespan,
    )
    app.state.engine = engine if engine is not None else Engine(config)
    app.state.sweep_service = SweepService(app.state.engine)
    install_error_handlers(app)
    install_auth(app, api_key)
    for module in (sweep_routes, steering_routes, capture_routes):
        app.include_router(module.router)
    from app.dashboard import mount as mount_dashboard

    mount_dashboard(app)

    @app.middleware("http")
    async def limit_body(request: Request, call_next):
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
            return error_response(413, f"body: request body of {length} bytes exceeds {MAX_BODY_BYTES}", "body")
        return await call_next(request)

    def eng() -> Engine:
        return app.state.engine

    @app.get("/health", tags=["status"], responses=ERRORS)
    async def health() -> JSONResponse:
        """Liveness: 200 while the engine serves, 503 once it has stopped."""
        if eng().alive:
            return JSONResponse({"status": "ok"})
        return error_response(503, "the vLLM engine is not running")

    @app.get("/v1/status", tags=["status"], response_model=StatusResponse, responses=ERRORS)
    async def status(request: Request) -> StatusResponse:
        """Model, layers, hooks, device, versions and load; the source-run store, the determinism
        checksum of applied interventions (per worker and compared across ranks), the global
        steering's sites, the number of named vectors and, when the server runs one, the
        patch-sweep service."""
        info = eng().info
        store = checksum = None
        if eng().alive:
            def control_plane() -> tuple[dict, dict]:
                return eng().source_store_usage(), eng().intervention_status()

            store, ivs = await run_in_threadpool(control_plane)
            checksum = {**ivs["determinism"], "workers": ivs["workers"]}
        sweep_service = getattr(request.app.state, "sweep_service", None)
        sweeps = sweep_service.status() if sweep_service is not None else None
        if inspect.isawaitable(sweeps):
            sweeps = await sweeps
        return StatusResponse(
            status="ok" if eng().alive else "dead",
            **{k: v for k, v in info.to_dict().items()},
            hooks=list(HOOKS),
            in_flight_requests=eng().in_flight,
            source_store=store,
            checksum=checksum,
            global_steering=active_sites(eng().global_steer),
            named_vectors=len(eng().list_vectors()),
            api_key_required=bool(request.app.state.api_key),
            sweeps=sweeps,
        )

    @app.post("/v1/tokenize", tags=["tokens"], response_model=TokenizeResponse, responses=ERRORS)
    async def tokenize(req: TokenizeRequest) -> TokenizeResponse:
        """Token ids and their display strings (axis labels for heatmaps)."""
        ids = eng().tokenize(req.prompt, add_special_tokens=req.add_special_tokens)
        return TokenizeResponse(
            tokens=ids, token_strings=eng().token_strings(ids), count=len(ids), max_model_len=eng().info.max_model_len
        )

    @app.post(
        "/v1/generate",
        tags=["generation"],
        response_model=GenerateResponse,
        responses={**GEN_ERRORS, 200: {"content": {"text/event-stream": {}}, "description": "JSON, or SSE when stream=true"}},
    )
    async def generate(req: GenerateRequest, request: Request):
        """Generate from a prompt, optionally with per-request `interventions` (steer, patch,
        capture, noise, score_token_ids); the result then carries `intervention` (status, errors,
        captures, stored_as, program_hash) and `scores`. With `stream: true`, server-sent events:
        `start` (prompt token ids), one `token` event per engine step, `done` (the whole result),
        then `data: [DONE]`. Bad requests are refused with a JSON 400 before any event."""
        params = req.params()
        spec = None
        if req.interventions is not None:
            if req.interventions.keeps_source():
                check_api_key(request)
            spec = req.interventions.to_spec("interventions")
        try:
            prompt_ids = eng().validate(req.prompt, params, spec)
        except SpecError as exc:
            raise by_prefix(exc, NATIVE_FIELDS) from None
        if not req.stream:
            gen = await eng().agenerate(req.prompt, params, spec)
            return GenerateResponse(**_generation_body(gen, req.prompt))

        async def events() -> AsyncIterator[str]:
            n = 0
            gen = Generation("", req.prompt, prompt_ids)
            yield sse_event({"type": "start", "prompt_token_ids": prompt_ids}, n)
            try:
                async for delta in eng().astream(req.prompt, params, spec):
                    gen.extend(delta)
                    n += 1
                    yield sse_event(
                        {"type": "token", "token_ids": delta.token_ids, "text": delta.text, "logprobs": delta.logprobs}, n
                    )
            except Exception as exc:  # engine failure mid-stream: tell the client, don't hang
                yield sse_event({"type": "error", "error": str(exc)}, n + 1)
                yield DONE
                return
            yield sse_event({"type": "done", **_generation_body(gen, req.prompt)}, n + 1)
            yield DONE

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.post("/v1/completions", tags=["generation"], responses=GEN_ERRORS)
    async def completions(req: CompletionRequest, request: Request):
        """OpenAI-compatible text completion (n = 1), streaming or not, with the reference fork's
        per-request fields (`steering_vectors` and its phase variants, `steering_name`, `patch` +
        `patch_vectors`, `logprob_token_ids`, `capture: {"patch_source": ...}`) and the native
        `interventions`. With interventions the body also carries `intervention`; with scored ids
        each choice carries `scores`. Fork fields causalboard cannot honour are refused (400)."""
        info = eng().info
        if req.model is not None and req.model not in (info.model, info.model_path):
            return error_response(404, f"model: '{req.model}' is not served here (serving '{info.model}')", "model")
        params = req.params()
        extras = completion_extras.build(req, eng())
        if extras.keeps_source():
            check_api_key(request)
        spec = None if extras.spec.is_empty() else extras.spec
        try:
            eng().validate(req.prompt, params, spec)
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
                "logprobs": _openai_logprobs(eng(), part.token_ids, part.logprobs, tops) if want_logprobs else None,
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
            gen = await eng().agenerate(req.prompt, params, spec)
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
                async for d in eng().astream(req.prompt, params, spec):
                    gen.extend(d)
                    chunk = {"id": cid, "object": "text_completion", "created": created, "model": info.model,
                             "choices": [choice_of(d, d.finished)]}
                    if d.finished:
                        chunk.update(intervention_fields(gen))
                    yield sse_event(chunk)
            except Exception as exc:
                yield sse_event({"error": str(exc)})
            yield DONE

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    return app


def _generation_body(gen: Generation, prompt: str) -> dict:
    body = gen.to_dict()
    body["prompt"] = prompt
    return body


def _openai_logprobs(engine: Engine, ids: list[int], lps: list[float], tops: list[dict[int, float]]) -> dict:
    strings = engine.token_strings(ids)
    top = [{engine.token_strings([t])[0]: v for t, v in d.items()} for d in tops] if tops else None
    return {"tokens": strings, "token_logprobs": lps, "top_logprobs": top}

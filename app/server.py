"""The causalboard HTTP API (FastAPI). Start it with `causalboard serve` (or `make run`).

`create_app(engine)` serves an already started `Engine` (tests share one engine per session);
`create_app(config=EngineConfig(...))` starts and stops its own engine in the app's lifespan.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from engine_ext import Engine, EngineConfig, Generation
from engine_ext.seam import INTERVENTIONS_ENABLED, SUPPORTED_HOOKS

from .errors import error_response, install_error_handlers
from .schemas import (
    CompletionRequest,
    ErrorResponse,
    GenerateRequest,
    GenerateResponse,
    StatusResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from .sse import DONE, sse_event

MAX_BODY_BYTES = 8 * 1024 * 1024
ERRORS = {400: {"model": ErrorResponse}, 404: {"model": ErrorResponse}, 413: {"model": ErrorResponse}, 503: {"model": ErrorResponse}}


def create_app(engine: Engine | None = None, config: EngineConfig | None = None) -> FastAPI:
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
            if owns_engine:
                eng.close()

    app = FastAPI(
        title="causalboard",
        version="0.1.0",
        summary="Causal tracing and activation steering on vLLM",
        lifespan=lifespan,
    )
    app.state.engine = engine if engine is not None else Engine(config)
    install_error_handlers(app)

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

    @app.get("/v1/status", tags=["status"], response_model=StatusResponse)
    async def status() -> StatusResponse:
        """Model, layers, hooks, device, versions and load."""
        info = eng().info
        return StatusResponse(
            status="ok" if eng().alive else "dead",
            **{k: v for k, v in info.to_dict().items()},
            hooks=list(SUPPORTED_HOOKS),
            interventions_enabled=INTERVENTIONS_ENABLED,
            in_flight_requests=eng().in_flight,
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
        responses={**ERRORS, 200: {"content": {"text/event-stream": {}}, "description": "JSON, or SSE when stream=true"}},
    )
    async def generate(req: GenerateRequest):
        """Generate from a prompt. With `stream: true`, server-sent events:
        `start` (prompt token ids), one `token` event per engine step, `done` (the whole result),
        then `data: [DONE]`. Bad requests are refused with a JSON 400 before any event."""
        params = req.params()
        prompt_ids = eng().validate(req.prompt, params)
        if not req.stream:
            gen = await eng().agenerate(req.prompt, params)
            return GenerateResponse(**_generation_body(gen, req.prompt))

        async def events() -> AsyncIterator[str]:
            n = 0
            gen = Generation("", req.prompt, prompt_ids)
            yield sse_event({"type": "start", "prompt_token_ids": prompt_ids}, n)
            try:
                async for delta in eng().astream(req.prompt, params):
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

    @app.post("/v1/completions", tags=["generation"], responses=ERRORS)
    async def completions(req: CompletionRequest):
        """OpenAI-compatible text completion (n = 1), streaming or not."""
        info = eng().info
        if req.model is not None and req.model not in (info.model, info.model_path):
            return error_response(404, f"model: '{req.model}' is not served here (serving '{info.model}')", "model")
        params = req.params()
        eng().validate(req.prompt, params)
        created = int(time.time())
        cid = f"cmpl-{time.time_ns():x}"
        if not req.stream:
            gen = await eng().agenerate(req.prompt, params)
            choice = {
                "index": 0,
                "text": gen.text,
                "logprobs": _openai_logprobs(eng(), gen.token_ids, gen.logprobs, gen.top_logprobs) if req.logprobs is not None else None,
                "finish_reason": gen.finish_reason,
            }
            usage = {
                "prompt_tokens": len(gen.prompt_token_ids),
                "completion_tokens": len(gen.token_ids),
                "total_tokens": len(gen.prompt_token_ids) + len(gen.token_ids),
            }
            return {"id": cid, "object": "text_completion", "created": created, "model": info.model, "choices": [choice], "usage": usage}

        async def events() -> AsyncIterator[str]:
            try:
                async for d in eng().astream(req.prompt, params):
                    choice = {
                        "index": 0,
                        "text": d.text,
                        "logprobs": _openai_logprobs(eng(), d.token_ids, d.logprobs, d.top_logprobs) if req.logprobs is not None else None,
                        "finish_reason": d.finish_reason if d.finished else None,
                    }
                    yield sse_event({"id": cid, "object": "text_completion", "created": created, "model": info.model, "choices": [choice]})
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

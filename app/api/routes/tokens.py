"""Routes: tokenization (see app/api/routes/__init__.py).

* `POST /v1/tokenize` — token ids and display strings, exactly as the engine computes on them.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends

from engine_ext import Engine

from app.api.deps import get_engine
from app.api.schemas.generation import ErrorResponse, TokenizeRequest, TokenizeResponse

router = APIRouter(tags=["tokens"])

ERRORS = {code: {"model": ErrorResponse} for code in (400, 413, 503)}


@router.post("/v1/tokenize", response_model=TokenizeResponse, responses=ERRORS)
async def tokenize(req: TokenizeRequest, engine: Engine = Depends(get_engine)) -> TokenizeResponse:
    """Token ids and their display strings (axis labels for heatmaps)."""
    ids = engine.tokenize(req.prompt, add_special_tokens=req.add_special_tokens)
    return TokenizeResponse(tokens=ids, token_strings=engine.token_strings(ids), count=len(ids),
                            max_model_len=engine.info.max_model_len)

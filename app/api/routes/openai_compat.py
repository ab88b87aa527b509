"""Routes: vLLM's own OpenAI-server endpoints that clients of the reference fork call (see
app/api/routes/__init__.py).

* `POST /tokenize`, `POST /detokenize` — at the root, in vLLM's request and response shapes
  (`model` accepted; the fork's `PatchStudy` counts prompt tokens and resolves spans with them).
  `/tokenize` takes a prompt, or chat `messages` rendered with the model's (or the request's)
  chat template.
* `GET /v1/models` — the served model, in vLLM's list shape (the fork's clients read the model
  name from it).
* `POST /v1/chat/completions` — OpenAI chat completion with the same extra fields as
  `/v1/completions` (`generation.py`); a model without a chat template and no `chat_template` in
  the request is a 400 naming `chat_template`.

Token ids are exactly those the engine computes on (the engine tokenizes with the same
tokenizer). causalboard's own `POST /v1/tokenize` (display strings for axis labels) is in
`tokens.py`.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, Field

from engine_ext import Engine
from engine_ext.errors import SpecError
from engine_ext.generation import MAX_TOP_LOGPROBS

from app.api.auth import CompletionAccess, completion_access
from app.api.deps import get_engine
from app.api.routes.generation import CompletionShape, run_completion
from app.api.schemas.generation import CompletionRequest, ErrorResponse
from app.wire import MAX_PROMPT_CHARS, StrictModel

router = APIRouter(tags=["openai"])

ERRORS = {code: {"model": ErrorResponse} for code in (400, 404, 503)}
_STARTED = int(time.time())


class VllmTokenizeRequest(StrictModel):
    """vLLM's `TokenizeCompletionRequest` (`prompt`) or `TokenizeChatRequest` (`messages`)."""

    model: str | None = Field(None, description="Ignored if it names the served model; 404 otherwise.")
    prompt: str | None = Field(None, max_length=MAX_PROMPT_CHARS, description="Text to tokenize (or give `messages`).")
    messages: list[dict[str, Any]] | None = Field(None, description="Chat messages, rendered with the chat template.")
    add_special_tokens: bool | None = Field(
        None, description="Add special tokens (BOS); default true for `prompt`, false for `messages` (as vLLM).")
    return_token_strs: bool | None = Field(False, description="Also return the token strings.")
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = Field(None, description="Jinja chat template (when the model has none).")
    chat_template_kwargs: dict[str, Any] | None = None


class VllmTokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class VllmDetokenizeRequest(StrictModel):
    model: str | None = Field(None, description="Ignored if it names the served model; 404 otherwise.")
    tokens: list[int] = Field(..., description="Token ids to decode.")


class VllmDetokenizeResponse(BaseModel):
    prompt: str


def check_model(engine: Engine, model: str | None) -> None:
    """A `model` field must name the served model (or its path); 404 otherwise."""
    info = engine.info
    if model is not None and model not in (info.model, info.model_path):
        raise ModelNotServed(model, info.model)


class ModelNotServed(SpecError):
    """`model` names another model: answered 404 (`app/api/errors.py` maps `status`)."""

    status = 404

    def __init__(self, model: str, served: str):
        super().__init__("model", f"'{model}' is not served here (serving '{served}')")


def render_chat(engine: Engine, messages: list[dict[str, Any]], *, chat_template: str | None,
                add_generation_prompt: bool, continue_final_message: bool,
                chat_template_kwargs: dict[str, Any] | None, field_name: str = "messages") -> str:
    """The chat `messages` as prompt text, with the request's template or the model's. A model
    without a chat template (and no `chat_template` given) is a 400 naming `chat_template`."""
    tok = engine.tokenizer
    if not messages:
        raise SpecError(field_name, "must hold at least one message")
    for k, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise SpecError(f"{field_name}[{k}]", "must be an object with a 'role'")
    if continue_final_message and add_generation_prompt:
        raise SpecError("continue_final_message", "cannot be combined with add_generation_prompt (set it to false)")
    template = chat_template or getattr(tok, "chat_template", None)
    if not template:
        raise SpecError("chat_template", f"the model '{engine.info.model}' has no chat template; give one in "
                                         "`chat_template` (or use /v1/completions with a prompt)")
    try:
        return tok.apply_chat_template(messages, chat_template=template, tokenize=False,
                                       add_generation_prompt=add_generation_prompt,
                                       continue_final_message=continue_final_message,
                                       **(chat_template_kwargs or {}))
    except Exception as exc:  # a template error is the request's fault (bad template or messages)
        raise SpecError("chat_template", f"rendering the chat template failed: {exc}") from None


@router.post("/tokenize", response_model=VllmTokenizeResponse, response_model_exclude_none=True, responses=ERRORS)
async def tokenize(req: VllmTokenizeRequest, engine: Engine = Depends(get_engine)) -> VllmTokenizeResponse:
    """vLLM's `/tokenize`: `{"prompt"}` or `{"messages"}` -> `{"count", "max_model_len", "tokens",
    "token_strs"}` (`token_strs` with `return_token_strs: true`)."""
    check_model(engine, req.model)
    if (req.prompt is None) == (req.messages is None):
        raise SpecError("prompt", "give exactly one of prompt or messages")
    if req.prompt is not None:
        ids = engine.tokenize(req.prompt, add_special_tokens=True if req.add_special_tokens is None else req.add_special_tokens)
    else:
        text = render_chat(engine, req.messages, chat_template=req.chat_template, add_generation_prompt=req.add_generation_prompt,
                           continue_final_message=req.continue_final_message, chat_template_kwargs=req.chat_template_kwargs)
        ids = engine.tokenize(text, add_special_tokens=bool(req.add_special_tokens))
    strs = engine.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
    return VllmTokenizeResponse(count=len(ids), max_model_len=engine.info.max_model_len, tokens=ids, token_strs=strs)


@router.post("/detokenize", response_model=VllmDetokenizeResponse, responses=ERRORS)
async def detokenize(req: VllmDetokenizeRequest, engine: Engine = Depends(get_engine)) -> VllmDetokenizeResponse:
    """vLLM's `/detokenize`: `{"tokens": [ids]}` -> `{"prompt": text}` (special tokens skipped)."""
    check_model(engine, req.model)
    vocab = engine.info.vocab_size
    for k, t in enumerate(req.tokens):
        if not 0 <= t < vocab:
            raise SpecError(f"tokens[{k}]", f"token id {t} is outside the vocabulary [0, {vocab})")
    return VllmDetokenizeResponse(prompt=engine.detokenize(req.tokens))


@router.get("/v1/models", responses=ERRORS)
async def models(engine: Engine = Depends(get_engine)) -> dict:
    """vLLM's model list: the one served model (`id` is the name `model` fields accept; `root` is
    that name too, not the folder it was loaded from: host paths stay out of answers)."""
    info = engine.info
    card = {"id": info.model, "object": "model", "created": _STARTED, "owned_by": "causalboard",
            "root": info.model, "parent": None, "max_model_len": info.max_model_len, "permission": []}
    return {"object": "list", "data": [card]}


# ---- chat completions -----------------------------------------------------------------------------
class ChatCompletionRequest(CompletionRequest):
    """OpenAI chat completion: `messages` rendered with the model's chat template (or the
    request's `chat_template`), then generated exactly as `/v1/completions` with the same fork
    fields and native `interventions` (positions index the rendered prompt's tokens; span
    selectors are not available, the prompt is sent as token ids)."""

    prompt: None = Field(None, description="Not used: give `messages`.")
    messages: list[dict[str, Any]] = Field(..., min_length=1, description="Chat messages ({role, content}).")
    logprobs: bool | None = Field(None, description="Return the chosen tokens' logprobs (OpenAI chat semantics).")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description="Alternatives per token (with logprobs).")
    max_completion_tokens: int | None = Field(None, ge=1, description="OpenAI's newer name for max_tokens (wins).")
    chat_template: str | None = Field(None, description="Jinja chat template (required when the model has none).")
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    def as_completion(self, prompt_ids: list[int]) -> CompletionRequest:
        data = {name: getattr(self, name) for name in CompletionRequest.model_fields if name in self.model_fields_set}
        if self.logprob_token_ids and not self.logprobs:
            raise SpecError("logprob_token_ids", "when using logprob_token_ids, logprobs must be set to true (the fork's rule)")
        data.update(prompt=prompt_ids, logprobs=(self.top_logprobs or 0) if self.logprobs else None)
        if self.max_completion_tokens is not None:
            data["max_tokens"] = self.max_completion_tokens
        return CompletionRequest.model_validate(data)


class ChatShape(CompletionShape):
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def logprobs(self, engine: Engine, ids: list[int], lps: list[float], tops: list[dict[int, float]] | None) -> dict:
        strings = engine.token_strings(ids)
        content = []
        for k, (tok, lp) in enumerate(zip(strings, lps)):
            alts = []
            if tops and k < len(tops):
                alts = [{"token": t, "logprob": v, "bytes": list(t.encode())}
                        for t, v in ((engine.token_strings([i])[0], v) for i, v in tops[k].items())]
            content.append({"token": tok, "logprob": lp, "bytes": list(tok.encode()), "top_logprobs": alts})
        return {"content": content}

    def choice(self, index: int, text: str, logprobs: dict | None, finish_reason: str | None) -> dict:
        return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                "finish_reason": finish_reason}

    def delta_choice(self, index: int, text: str, logprobs: dict | None, finish_reason: str | None, first: bool) -> dict:
        delta = {"role": "assistant", "content": text} if first else {"content": text}
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


@router.post("/v1/chat/completions", responses={**ERRORS, 401: {"model": ErrorResponse}})
async def chat_completions(req: ChatCompletionRequest, request: Request, access: CompletionAccess = Depends(completion_access)):
    """OpenAI chat completion (n = 1) with the same extra fields as `/v1/completions` (the fork's
    and the native `interventions`). A model without a chat template needs `chat_template` in the
    request (400 naming it otherwise)."""
    engine = access.engine
    check_model(engine, req.model)
    text = render_chat(engine, req.messages, chat_template=req.chat_template, add_generation_prompt=req.add_generation_prompt,
                       continue_final_message=req.continue_final_message, chat_template_kwargs=req.chat_template_kwargs)
    ids = engine.tokenize(text, add_special_tokens=False)  # the template writes its special tokens (as vLLM)
    return await run_completion(req.as_completion(ids), engine, access.guard, ChatShape(), access.settings, request)

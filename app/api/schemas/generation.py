"""Request and response bodies of the HTTP API (the one canonical wire form).

Every request model forbids unknown fields, so a typo is a 400 naming the field instead of a
silently ignored option. Field descriptions and bounds become the OpenAPI page.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

from engine_ext.generation import MAX_TOP_LOGPROBS, GenerationParams

from app.api.schemas.dynamic import DynamicSpec
from app.api.schemas.interventions import (
    ClampTier,
    ForkPatchEntry,
    InterventionResultBody,
    InterventionsSpec,
    PackedTable,
    SourceStoreUsage,
    VectorSpec,
)
from app.wire import MAX_PROMPT_CHARS, StrictModel


class SamplingFields(StrictModel):
    max_tokens: int = Field(16, ge=1, description="Number of tokens to generate (>= 1).")
    temperature: float = Field(0.0, ge=0.0, description="0 = greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, description="0 disables top-k filtering.")
    seed: int | None = Field(None, description="Per-request sampling seed.")
    stop: list[str] | str | None = Field(None, description="Stop strings (not included in the output).")
    ignore_eos: bool = False

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class GenerateRequest(SamplingFields):
    """causalboard's native generation request."""

    prompt: str = Field(..., min_length=1, max_length=MAX_PROMPT_CHARS, description="The prompt text.")
    logprobs: int | None = Field(
        None, ge=0, le=MAX_TOP_LOGPROBS,
        description="null (default): no per-token logprobs (not computed); 0: the chosen token's logprob per generated "
                    "token; k > 0: also the top-k alternatives.")
    stream: bool = Field(False, description="Stream token deltas as server-sent events.")
    interventions: InterventionsSpec | None = Field(
        None, description="Per-request steer / patch / capture / noise / score_token_ids (see docs/concepts.md). "
                          "A capture with keep_as needs the API key when the server has one.")
    dynamic: DynamicSpec | None = Field(
        None, description="Dynamic steering: policies (probe-gated or closed-loop) and a conversation_id; the per-token "
                          "trace returns in intervention.dynamic (see docs/dynamic-steering.md).")

    def params(self) -> GenerationParams:
        return GenerationParams(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            logprobs=self.logprobs,
            stop=self.stop_list(),
            ignore_eos=self.ignore_eos,
        )


class GenerateResponse(BaseModel):
    request_id: str
    prompt: str
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    logprobs: list[float] = Field(description="Logprob of each generated token (empty unless `logprobs` was requested).")
    top_logprobs: list[dict[str, float]] = Field(description="Per generated token: token id -> logprob (top-k).")
    finish_reason: str | None
    scores: list[dict[str, float]] = Field(
        default_factory=list, description="Per generated token: logprob of each requested score_token_ids id.")
    intervention: InterventionResultBody | None = Field(None, description="Present when the request had interventions or dynamic steering (its own or the server's global policies).")
    num_cached_tokens: int = Field(0, description="Prompt tokens whose KV came from the prefix cache (not recomputed).")


class CompletionRequest(SamplingFields):
    """OpenAI-style `/v1/completions` (a prompt or a list of them, one choice each; n = 1), with the reference fork's extra fields
    (steering vectors, patches, exact scoring, patch_source capture) and causalboard's native
    `interventions`. Fork fields causalboard cannot honour are refused with 400, never ignored."""

    model: str | None = Field(None, description="Ignored if it names the served model; 404 otherwise.")
    prompt: Annotated[str, Field(min_length=1, max_length=MAX_PROMPT_CHARS)] | list[Annotated[int, Field(ge=0)]] \
        | list[list[Annotated[int, Field(ge=0)]]] | list[Annotated[str, Field(min_length=1, max_length=MAX_PROMPT_CHARS)]] = Field(
        ..., description="Text, token ids, or a list of texts / token-id lists (one choice per prompt, as vLLM).")
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description="OpenAI semantics: top-k logprobs per token.")
    cache_salt: str | None = Field(None, min_length=1, description="vLLM's cache_salt: prefix-cache blocks are shared only "
                                                                   "among requests with the same salt.")
    stream: bool = False
    n: Literal[1] = 1
    echo: Literal[False] = False
    user: str | None = None
    # ---- the reference fork's per-request fields
    steering_vectors: VectorSpec = Field(None, description="Fork: steering at every position (dict or packed form).")
    prefill_steering_vectors: VectorSpec = Field(None, description="Fork: steering at prompt positions only.")
    decode_steering_vectors: VectorSpec = Field(None, description="Fork: steering at generated positions only.")
    steering_name: str | None = Field(None, description="Fork: steer with a registered steering module (scale 1).")
    patch: list[ForkPatchEntry] | None = Field(None, description="Fork: activation patches, one site and position each.")
    patch_vectors: PackedTable | None = Field(None, description="Fork: the table that patch[i].source_inline indexes.")
    logprob_token_ids: list[int] | None = Field(
        None, description="Fork: exact logprobs of these ids (at most 128) at every generated step, instead of the top-k; "
                          "`logprobs` must then be set (any value, as in the fork). An empty list is the same as none. "
                          "Returned as top_logprobs and as `scores`.")
    capture: dict | None = Field(
        None, description="Fork: capture consumers; {'patch_source': {'run'?, 'hooks': {hook: 'all' | [layers] | "
                          "{'layers', 'ranges'}}, 'positions'}} stores a source run (needs the API key when one is set; "
                          "`run` defaults to the completion's id).")
    capture_wait: bool | None = Field(None, description="Fork: accepted; a capture is always durable when the response returns.")
    steering_clamps: ClampTier = Field(None, description="Fork: directional clamps at every position, {hook: {layer: "
                                                         "[{'vector', 'min'?, 'max'?, 'strength'?} | {'vector', 'value'}]}} "
                                                         "(or the fork's packed / wire-map forms).")
    prefill_steering_clamps: ClampTier = Field(None, description="Fork: clamps at prompt positions only (after the base tier's).")
    decode_steering_clamps: ClampTier = Field(None, description="Fork: clamps at generated positions only (after the base tier's).")
    steering: Any = Field(
        None, description="Fork: declarative steering gates, a list of {'when': {'kind': 'always'} | {'kind': 'probe', "
                          "'probe': SRC, 'threshold', 'sharpness'?}, 'scope': 'this_token' | 'next_step' | 'rest_of_request' | "
                          "'rest_of_conversation', 'apply': {'kind': 'add', 'steer': SRC, 'strength'?} | {'kind': 'attenuate', "
                          "'strength'}} with SRC {'kind': 'name', 'name'} (the /v1/steering/vectors/register registry) or "
                          "{'kind': 'inline', 'packed': {hook: packed}}; run as dynamic steering (docs/dynamic-steering.md). "
                          "'clamp' gates are refused (400), as in the fork.")
    conversation_id: str | None = Field(
        None, description="Fork: the conversation this request belongs to, for the server's global dynamic-steering "
                          "policies (`latch: conversation`) and the `rest_of_conversation` gates of `steering`; echoed "
                          "in the response.")
    # ---- causalboard
    interventions: InterventionsSpec | None = Field(None, description="Native per-request interventions (as on /v1/generate).")

    def params(self) -> GenerationParams:
        return GenerationParams(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            logprobs=0 if self.logprob_token_ids else self.logprobs,
            stop=self.stop_list(),
            ignore_eos=self.ignore_eos,
            cache_salt=self.cache_salt,
        )

    def prompts(self) -> tuple[list[str | list[int]], bool]:
        """The prompts (text or token ids) and whether the request had one (not a list of them)."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p], True
        return list(p), False


class TokenizeRequest(StrictModel):
    prompt: str = Field(..., max_length=MAX_PROMPT_CHARS)
    add_special_tokens: bool = True


class TokenizeResponse(BaseModel):
    tokens: list[int]
    token_strings: list[str] = Field(description="Display string of each token (for axis labels).")
    count: int
    max_model_len: int


class ErrorResponse(BaseModel):
    error: str = Field(description="Human-readable message; starts with the offending field.")
    field: str | None = Field(None, description="The offending field, when there is one: a path with list indices in "
                                                "brackets and object keys after dots (`interventions.steer[0].scale`).")
    errors: list[dict] | None = Field(None, description="All validation problems, one per field.")


class PipelineStage(BaseModel):
    pp_rank: int = Field(description="The stage's rank in the pipeline.")
    layers: list[int] = Field(description="First and last decoder layer the stage computes (inclusive).")
    tp_ranks: list[int] = Field(description="Its tensor-parallel ranks (each holds the whole residual stream of those layers).")


class Topology(BaseModel):
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    stages: list[PipelineStage] = Field(default_factory=list)


class StatusResponse(BaseModel):
    status: Literal["ok", "dead"]
    model: str = Field(description="The served model's name (its folder's name; `causalboard-tiny` for the bundled one). "
                                    "The server's filesystem path is never reported.")
    architecture: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    max_model_len: int
    max_num_seqs: int = Field(0, description="Requests the engine batches at once.")
    device: str
    dtype: str
    enforce_eager: bool
    batch_invariant: bool = Field(False, description="A request's numbers do not depend on its batch: vLLM's batch-invariant "
                                                     "kernels (GPU), row-invariant linear layers (CPU).")
    cpu_gemm: dict[str, int] = Field(default_factory=dict, description="CPU with batch invariance: how many linear layers "
                                     "kept the host's own kernel, row-invariant there ('native'), or run it in fixed "
                                     "16-row calls ('chunked') or one row per call ('per_row'); empty elsewhere.")
    kv_isolation: Literal["blocks", "requests"] = Field(
        "blocks", description="How KV blocks computed under an intervention are kept from other requests: 'blocks' (salted "
                              "from the first modified position; earlier blocks stay shared) or 'requests' (whole intervened "
                              "requests salted: several ranks without the installed plugin entry point, docs/distributed.md).")
    topology: Topology = Field(default_factory=Topology, description="TP x PP and the layers each pipeline stage computes.")
    hooks: list[str] = Field(description="Hooks the engine can intervene on, per layer (residual stream and MLP branch).")
    versions: dict[str, str]
    startup_seconds: float
    in_flight_requests: int
    source_store: SourceStoreUsage | None = Field(None, description="Source-run store usage (as GET /v1/patch_source).")
    checksum: dict | None = Field(
        None, description="Cross-rank determinism of applied interventions: {'consistent', 'action_count' | 'mismatches' and "
                          "'checksums', 'ranks', 'workers': [per-worker checksum, action_count, tp_rank, pp_rank]}.")
    global_steering: list[str] = Field(default_factory=list, description="Sites the global steering (vectors and clamps) touches.")
    named_vectors: int = Field(0, description="Registered named vectors (module vectors included).")
    api_key_required: bool = Field(False, description="Whether mutating endpoints need 'Authorization: Bearer <key>'.")
    sweeps: dict | None = Field(None, description="Patch-sweep service status, when the server runs one.")
    dynamic: dict | None = Field(None, description="Dynamic steering, as GET /v1/steering/dynamic (probes, global policies, "
                                                   "per-worker state, determinism).")

"""Request and response bodies of the intervention endpoints: steering, named vectors, steering
modules, capture, stored source runs, and the `interventions` field of the generation endpoints.

Request models forbid unknown fields. pydantic is the one structural parser (types, required
fields, bounds, unknown fields); the native specs (`SteerSpec`, `PatchSpec`, `CaptureSpec`,
`EmbeddingNoiseSpec`, `InterventionsSpec`) then build `engine_ext.specs` objects through their
`make(...)` constructors, which add the semantic checks (finite numbers, site text, position
selectors, patch sources). Every error names its field the same way, with indices in brackets:
`interventions.steer[0].scale` whether the scale is a string (pydantic) or NaN (`Steer.make`);
checks against the model and the prompt (layer out of range, wrong dimension, unknown named
vector, span not found) come from the engine under the same names. The reference fork's
dict-keyed vector tiers (`vectors`, `steering_vectors`, ...) are parsed field by field in
`app/fork/vectors.py`; their JSON schema is documented here.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, WithJsonSchema

from engine_ext.sites import HOOKS, Site
from engine_ext.specs import Capture, Clamp, Interventions, Noise, Patch, Steer

from app.fork.clamps import CLAMP_SPEC_SCHEMA
from app.fork.vectors import VECTOR_SPEC_SCHEMA
from app.wire import MAX_PROMPT_CHARS, SpanSpec, StrictModel

#: a field the reference fork has and causalboard refuses (400 naming it, never ignored)
NOT_SUPPORTED = "Not supported by causalboard: a request that sets it is refused with 400 naming the field."


def unsupported(description: str = NOT_SUPPORTED) -> Any:
    return Field(None, description=description)


# ---- native intervention specs (-> engine_ext.specs) -----------------------------------------------
class SiteSpec(StrictModel):
    layer: int = Field(..., ge=0)
    hook: Literal[HOOKS] = Field(..., description=" | ".join(HOOKS))  # type: ignore[valid-type]

    def to_site(self) -> Site:
        return Site(self.layer, self.hook)


Positions = Annotated[
    str | int | SpanSpec | list[int | SpanSpec],
    Field(description="'last_prompt' | 'all_prompt' | 'all_generated' | 'all' | token indices (negative = from the "
                      "end of the prompt) | {'span': text, 'occurrence': n} | a list mixing indices and spans"),
]
Sites = Annotated[str | list[str | SiteSpec], Field(description="Sites written 'L3.post_block' (or {'layer', 'hook'}).")]
DimMask = Annotated[
    dict[str, Any] | list[int] | list[bool] | None,
    Field(None, description="Dimension mask: {'indices': [dims]} (the reference fork's form) | a list of dimension indices | "
                            "a list of booleans (one per dimension) | {'weights': [values in [0, 1]]} (graded)."),
]


def engine_positions(value: str | int | SpanSpec | list[int | SpanSpec]) -> Any:
    """A parsed `Positions` value in the form `engine_ext.specs` selectors take (spans -> `Span`)."""
    if isinstance(value, list):
        return [p.to_span() if isinstance(p, SpanSpec) else p for p in value]
    return value.to_span() if isinstance(value, SpanSpec) else value


def engine_sites(value: str | list[str | SiteSpec]) -> Any:
    """A parsed `Sites` value in the form `engine_ext.specs` takes (site text or `Site`)."""
    if isinstance(value, list):
        return [s.to_site() if isinstance(s, SiteSpec) else s for s in value]
    return value


class SteerSpec(StrictModel):
    """Add `scale * vector` at `sites` and `positions` during `phase` (with a `mask`, only on the
    masked dimensions: `scale * m * vector`). Exactly one of an inline `vector` and a registered `name`."""

    sites: Sites
    vector: list[float] | None = Field(None, description="Inline vector (length = hidden size).")
    name: str | None = Field(None, description="A registered named vector.")
    scale: float = 1.0
    positions: Positions = "all"
    phase: Literal["both", "prefill", "decode"] = Field("both", description="prefill = prompt positions, decode = generated ones.")
    mask: DimMask = None

    def to_steer(self, field_name: str) -> Steer:
        """The engine's `Steer`; `SpecError`s name `field_name.<field>`."""
        return Steer.make(engine_sites(self.sites), self.vector, name=self.name, scale=self.scale,
                          positions=engine_positions(self.positions), phase=self.phase, mask=self.mask,
                          field_name=field_name)


class ClampSpec(StrictModel):
    """Directional clamp: at `sites` and `positions` during `phase`, the projection of the stream
    onto `vector / |vector|` is clipped to [`min`, `max`] (`value`: both) with `strength`:
    `s + strength * (clip(p, min, max) - p) * v`. After every patch and add at the site."""

    sites: Sites
    vector: list[float] = Field(..., min_length=1, description="Direction (length = hidden size; normalised here).")
    min: float | None = Field(None, description="Lower bound of the projection (null: open).")
    max: float | None = Field(None, description="Upper bound of the projection (null: open).")
    value: float | None = Field(None, description="Pin the projection: min = max = value.")
    strength: float = Field(1.0, description="Fraction of the correction applied, in [0, 1].")
    positions: Positions = "all"
    phase: Literal["both", "prefill", "decode"] = Field("both", description="prefill = prompt positions, decode = generated ones.")

    def to_clamp(self, field_name: str) -> Clamp:
        return Clamp.make(engine_sites(self.sites), self.vector, min=self.min, max=self.max, value=self.value,
                          strength=self.strength, positions=engine_positions(self.positions), phase=self.phase,
                          field_name=field_name)


class PatchSpec(StrictModel):
    """At one `site` and destination `positions`: `(1 - alpha) * h + alpha * t`, `t` from `source`
    (with a `mask`, per dimension `(1 - alpha * m) * h + alpha * m * t`: other dimensions are kept)."""

    site: str | SiteSpec
    positions: Positions = "all_prompt"
    source: str | dict[str, Any] = Field(
        ..., description="'zeros' | {'run': id, 'positions': [...]} (a stored source run) | {'vectors': [[...]]} | {'mean_of': run_id}")
    alpha: float = 1.0
    mask: DimMask = None

    def to_patch(self, field_name: str) -> Patch:
        site = self.site.to_site() if isinstance(self.site, SiteSpec) else self.site
        return Patch.make(site, engine_positions(self.positions), self.source, alpha=self.alpha, mask=self.mask,
                          field_name=field_name)


class CaptureSpec(StrictModel):
    sites: Sites
    positions: Positions = "last_prompt"
    keep_as: str | None = Field(None, description="Store the capture as a source run with this id (needs the API key when one is set).")
    return_values: bool = True

    def to_capture(self, field_name: str) -> Capture:
        return _capture(self, field_name)


def _capture(req: CaptureSpec | CaptureRequest, field_name: str) -> Capture:
    return Capture.make(engine_sites(req.sites), engine_positions(req.positions), keep_as=req.keep_as,
                        return_values=req.return_values, field_name=field_name)


class EmbeddingNoiseSpec(StrictModel):
    """One seeded draw of ROME-style noise on the input embeddings at `positions` (scale x
    embedding std) of this request (`engine_ext.specs.Noise`). Not the patch sweep's `noise`
    (`app.sweep.schema.NoiseSpec`), which describes a corruption recipe of several draws."""

    positions: Positions
    scale: float = Field(3.0, ge=0)
    seed: int = Field(0, ge=0)

    def to_noise(self, field_name: str) -> Noise:
        return Noise.make(engine_positions(self.positions), scale=self.scale, seed=self.seed, field_name=field_name)


class InterventionsSpec(StrictModel):
    """Per-request interventions (the wire form of `engine_ext.specs.Interventions`)."""

    steer: list[SteerSpec] = Field(default_factory=list)
    patch: list[PatchSpec] = Field(default_factory=list)
    capture: CaptureSpec | None = None
    noise: EmbeddingNoiseSpec | None = None
    score_token_ids: list[int] = Field(default_factory=list, description="Exact logprobs of these ids at every generated step.")
    clamp: list[ClampSpec] = Field(default_factory=list, description="Directional clamps (after patches and steering).")

    def to_spec(self, field_name: str = "interventions") -> Interventions:
        """The engine's `Interventions`, built entry by entry; `SpecError` fields start with
        `field_name` (`interventions.steer[0].scale`)."""
        f = field_name
        return Interventions(
            steer=tuple(s.to_steer(f"{f}.steer[{k}]") for k, s in enumerate(self.steer)),
            patch=tuple(p.to_patch(f"{f}.patch[{k}]") for k, p in enumerate(self.patch)),
            capture=self.capture.to_capture(f"{f}.capture") if self.capture is not None else None,
            noise=self.noise.to_noise(f"{f}.noise") if self.noise is not None else None,
            score_token_ids=tuple(self.score_token_ids),
            clamp=tuple(c.to_clamp(f"{f}.clamp[{k}]") for k, c in enumerate(self.clamp)),
        )

    def keeps_source(self) -> bool:
        return self.capture is not None and self.capture.keep_as is not None


class CaptureValue(BaseModel):
    layer: int
    hook: str
    position: int
    value: list[float]


class InterventionResultBody(BaseModel):
    """What the workers report for a request with interventions. `status` is 'ok' or 'voided'
    (a source run was missing/evicted, a named vector vanished, capacity exceeded): a voided
    request's output must not be used as an intervened result."""

    status: str
    errors: list[str]
    stored_as: str | None = None
    evicted: list[str] = Field(default_factory=list)
    program_hash: str | None = None
    captures: list[CaptureValue] = Field(default_factory=list)
    dynamic: dict | None = Field(None, description="Dynamic steering: policies, per-token trace (per policy: position, score, "
                                                   "threshold, engaged, scale), actions, latched, conversation_id.")


# ---- the fork's vector tiers and per-request extras -------------------------------------------------
VectorSpec = Annotated[Any, WithJsonSchema(VECTOR_SPEC_SCHEMA)]
ClampTier = Annotated[Any, WithJsonSchema(CLAMP_SPEC_SCHEMA)]


class PackedTable(StrictModel):
    """The fork's packed vector table: base64 of `shape[0]` little-endian rows of `shape[1]` values."""

    dtype: Literal["float32", "float16", "bfloat16", "float64"] = "float32"
    shape: list[int] = Field(..., min_length=2, max_length=2)
    data: str


class ForkPatchEntry(StrictModel):
    """One fork-style patch: at `(layer, hook)` and token `dest_position`, replace (alpha = 1) or
    lerp with exactly one source: a stored run (`source_run` + `source_position`, default the
    destination), `source_module` ('zeros', a steering module's base vector at this site, or a
    named vector), or `source_inline` (a row of `patch_vectors`)."""

    layer: int = Field(..., ge=0)
    hook: str = "post_block"
    dest_position: int = Field(..., ge=0)
    source_run: str | None = None
    source_position: int | None = Field(None, ge=0)
    source_module: str | None = None
    source_inline: int | None = Field(None, ge=0)
    alpha: float = 1.0
    mask: Any = Field(None, description="Dimension mask: {'indices': [dims]} or {'inline': row of patch_vectors} (graded "
                                        "weights in [0, 1]); only these dimensions take the source value.")


# ---- steering ------------------------------------------------------------------------------------
class SteeringSetRequest(StrictModel):
    """Global steering (every request). Fork tiers: `vectors` (both phases), `prefill_vectors`,
    `decode_vectors`; or native `steer` entries. `replace: false` merges with the current
    steering (an entry replaces the current ones at the same site and phase)."""

    vectors: VectorSpec = Field(None, description="Base tier: prefill and decode.")
    prefill_vectors: VectorSpec = Field(None, description="Added during prefill (prompt positions) only.")
    decode_vectors: VectorSpec = Field(None, description="Added during decode (generated positions) only.")
    steer: list[SteerSpec] | None = Field(
        None, description="Native entries; positions 'all', 'all_generated' or absolute indices.")
    replace: bool = Field(False, description="Replace the whole global steering instead of merging.")
    target: str | None = Field(None, description="'main' or omitted ('draft' models are not supported).")
    clamps: ClampTier = Field(None, description="Fork: global directional clamps at every position (both phases).")
    prefill_clamps: ClampTier = Field(None, description="Fork: global clamps at prompt positions only.")
    decode_clamps: ClampTier = Field(None, description="Fork: global clamps at generated positions only.")
    clamp: list[ClampSpec] | None = Field(
        None, description="Native clamp entries; positions 'all', 'all_generated' or absolute indices.")


class SteeringSetResponse(BaseModel):
    status: Literal["ok"] = "ok"
    hook_points: list[str] = Field(description="Hooks named by this request.")
    layers_updated: list[int] = Field(description="Layers named by this request.")
    sites: list[str] = Field(description="Every site the global steering now touches.")


class ActiveSteer(BaseModel):
    """One global steering entry (the native form; POST it back to /v1/steering/set as `steer`)."""

    sites: list[str]
    vector: list[float] | None
    name: str | None
    scale: float
    positions: Any
    phase: str
    norm: float = Field(description="|scale * vector| of this entry.")


class ActiveClamp(BaseModel):
    """One global clamp (the native form; POST it back to /v1/steering/set as `clamp`)."""

    sites: list[str]
    vector: list[float]
    min: float | None
    max: float | None
    strength: float
    positions: Any
    phase: str


class SteeringStatusResponse(BaseModel):
    active_layers: dict[str, dict[str, dict[str, float]]] = Field(
        description="Fork shape: layer -> hook -> {'norm': |sum of both-phase vectors|, 'prefill_norm', "
                    "'decode_norm'}, each rounded to 6 decimals and left out when zero (clamps are not listed "
                    "here, as in the fork).")
    steer: list[ActiveSteer]
    clamp: list[ActiveClamp] = Field(default_factory=list, description="The global directional clamps.")


class LayerHooks(BaseModel):
    hook_points: list[str]


class SteeringLayersResponse(BaseModel):
    layers: dict[str, LayerHooks]


class StatusOk(BaseModel):
    status: Literal["ok"] = "ok"


class VectorRegisterRequest(StrictModel):
    name: str = Field(..., min_length=1, max_length=128, description="1-128 characters of letters, digits, '_', '-', '.', ':' (the set of `keep_as`); names starting with 'module/' are reserved.")
    vector: list[float] = Field(..., min_length=1, description="Length = the model's hidden size; finite values.")


class VectorInfo(BaseModel):
    name: str
    dim: int
    norm: float


class VectorValues(VectorInfo):
    vector: list[float]


class VectorList(BaseModel):
    vectors: dict[str, list[str]] = Field(description="The fork's probe/steer registry: {'probe': [names], 'steer': [names]}.")
    count: int = Field(description="Names in the probe/steer registry (the fork's count).")
    named: list[VectorInfo] = Field(description="causalboard's named vectors (module vectors included).")
    named_count: int = Field(description="Number of named vectors.")
    max_count: int = Field(description="Most named vectors the engine holds.")


class VectorDeleted(BaseModel):
    name: str
    deleted: bool


class ModuleRegisterRequest(StrictModel):
    """A steering module: per-(hook, layer) vectors and/or directional clamps in up to three tiers
    (fork form). Vectors are stored as named vectors `module/<name>/<phase>/L<layer>.<hook>`."""

    name: str = Field(..., min_length=1, max_length=64)
    kind: str = Field("additive", description="Only 'additive' ('sae_delta' is not supported).")
    vectors: VectorSpec = None
    prefill_vectors: VectorSpec = None
    decode_vectors: VectorSpec = None
    clamps: ClampTier = Field(None, description="Directional clamps applied in both phases (the fork's tiers).")
    prefill_clamps: ClampTier = Field(None, description="Clamps at prompt positions only.")
    decode_clamps: ClampTier = Field(None, description="Clamps at generated positions only.")
    sae_manifest: Any = unsupported()


class ModuleUnregisterRequest(StrictModel):
    name: str = Field(..., min_length=1, max_length=64)


class ModuleEntry(BaseModel):
    site: str
    phase: str
    norm: float
    kind: Literal["vector", "clamp"] = "vector"
    min: float | None = Field(None, description="A clamp's lower bound (null: open).")
    max: float | None = Field(None, description="A clamp's upper bound (null: open).")
    strength: float | None = Field(None, description="A clamp's strength.")


class ModuleResponse(BaseModel):
    status: Literal["ok"] = "ok"
    name: str
    modules: list[str]


class ModuleList(BaseModel):
    modules: list[str]
    count: int
    details: dict[str, list[ModuleEntry]]


# ---- capture and source runs -----------------------------------------------------------------------
class CaptureRequest(StrictModel):
    """Run `prompt` (one generated token) recording `sites` x `positions` of the prompt."""

    prompt: str = Field(..., min_length=1, max_length=MAX_PROMPT_CHARS)
    sites: Sites
    positions: Positions = "last_prompt"
    keep_as: str | None = Field(None, description="Also store the run for patching under this id (needs the API key when one is set).")
    return_values: bool = Field(True, description="Return the values (false: only store them).")
    format: Literal["json", "npz", "safetensors"] = Field(
        "json", description="json, or a binary body: one float32 array [positions, hidden] per site (key = site text).")

    def to_capture(self, field_name: str = "capture") -> Capture:
        """The engine's `Capture` of `sites` x `positions`; `SpecError`s name `field_name.<field>`."""
        return _capture(self, field_name)


class CaptureResponse(BaseModel):
    prompt_token_ids: list[int]
    token_strings: list[str]
    positions: list[int] = Field(description="The captured prompt positions (rows of every array).")
    sites: list[str]
    captures: dict[str, list[list[float]]] = Field(description="site -> one vector per position.")
    stored_as: str | None
    program_hash: str | None = None


class SourceRunInfo(BaseModel):
    run_id: str
    bytes: int
    values: int = Field(description="Stored (site, position) values.")
    leases: int


class SourceStoreUsage(BaseModel):
    budget_bytes: int
    used_bytes: int
    evictions: int
    runs: list[SourceRunInfo]


class SourceDropped(BaseModel):
    dropped: Literal[True] = True
    run_id: str

"""The patch sweep's wire format, declared once: the request (`PatchSweepRequest`), the summary
(`SweepSummary`: the JSON answer of `POST /v1/patch_sweep` and its last stream event), the running
state (`SweepStatus`) and the stream's events (`SweepEvent`, one model per `type`).

Request field names and meanings are the reference fork's (`PatchSweepRequest`), so its clients
work unchanged; causalboard's extensions (`prob`, `recovered_basis`, `noise`, `subject`,
`max_concurrency`, `noise_floor_samples`) are optional. Hooks are `engine_ext.sites.HOOKS` (the
fork's five: `pre_attn`, `post_attn`, `mlp_in`, `mlp_out`, `post_block`).

Response models are exact (`extra="forbid"`): the server builds its summary and events from them,
so it cannot send a key they do not declare. Their fields' descriptions are the API's
documentation (OpenAPI). Reading is forward compatible: `parse_event` (the one entry point for
decoding an event) ignores event types and fields this version does not know, and fields a reader
can do without have defaults, so streams of older servers and saved summaries still parse. A few
optional keys are left out of the JSON when they have no value (`cell.error`, `cell.raw`, the
checksum's per-outcome keys, `source.run_id` / `source.name`) — exactly as the server always sent
them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal, Union, get_args

from pydantic import (BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, TypeAdapter, ValidationError,
                      ValidationInfo, model_serializer, model_validator)

from app.wire import MAX_PROMPT_CHARS, SpanSpec, StrictModel
from engine_ext.sites import HOOKS

METRICS = ("logprob", "logit_diff", "recovered", "prob")
BASES = ("logprob", "logit_diff", "prob")
Metric = Literal["logprob", "logit_diff", "recovered", "prob"]
Basis = Literal["logprob", "logit_diff", "prob"]


class LayerRange(StrictModel):
    start: int = Field(0, ge=0)
    stop: int = Field(..., ge=0)
    step: int = Field(1, ge=1)


class NoiseSpec(StrictModel):
    """ROME-style corruption: Gaussian noise of `scale` x (std of the embedding matrix) added to
    the input embeddings at `span` (or `positions`) of `prompt`; the clean run is the prompt
    without noise. `samples` noise draws (seeds `seed`, `seed+1`, ...) are averaged."""

    span: str | None = Field(None, min_length=1, description="Text whose tokens get noise.")
    occurrence: int = Field(0, ge=0)
    positions: list[int] | None = Field(None, description="Token positions instead of a span.")
    scale: float = Field(3.0, ge=0.0, le=100.0)
    seed: int = Field(0, ge=0)
    samples: int = Field(1, ge=1, le=32)


class PatchSweepRequest(StrictModel):
    model: str | None = Field(None, description="Ignored if it names the served model; 404 otherwise.")
    prompt: str = Field(..., min_length=1, max_length=MAX_PROMPT_CHARS, description="The corrupted (destination) prompt.")
    clean_prompt: str | None = Field(None, min_length=1, max_length=MAX_PROMPT_CHARS,
                                     description="Clean prompt: captured automatically when `source_run` is absent or not stored; drives alignment.")
    source_run: str | None = Field(None, min_length=1, max_length=200, description="Id of a stored clean run to patch from.")
    source_module: str | None = Field(None, description='Ablation source instead of a clean run: "zeros", "mean" (mean of the clean run over positions), a steering module (its vector at each cell\'s own hook and layer) or a registered vector name.')
    source_inline: int | None = Field(None, ge=0, description="Ablation source: this row of `patch_vectors`, patched into every cell.")
    patch_vectors: dict | None = Field(None, description="Packed table {dtype, shape: [n_rows, hidden], data: base64} that `source_inline` (or a mask's `inline`) indexes.")
    mask: dict | list | None = Field(None, description='Partial-dimension patches: only these dimensions of each cell take the source value, '
                                                      '(1 - alpha m) h + alpha m t. {"indices": [dims]} (the fork\'s form), {"inline": row of '
                                                      'patch_vectors} (the fork\'s graded form), a list of dimension indices, a list of booleans '
                                                      '(one per dimension) or {"weights": [values in [0, 1]]}.')
    hook: str = Field("post_block", description="Hook of every cell: " + ", ".join(HOOKS) + ".")
    hooks: list[str] | None = Field(None, min_length=1, description="Several hooks (or one): one grid per hook in `hook_grids`, in this order (wins over `hook`).")
    layers: list[int] | LayerRange | None = Field(None, description="Layer list or {start, stop, step} (range semantics); default all layers.")
    positions: Literal["all_prompt"] | list[int | SpanSpec] = Field("all_prompt", description='"all_prompt", token indices, {"span", "occurrence"} or a mix.')
    alpha: float = Field(1.0, allow_inf_nan=False, description="(1 - alpha) * h + alpha * source; 1 = replace (exact); any finite value (beyond [0, 1]: extrapolation).")
    answer_token: str | None = Field(None, description="The answer as text; must be exactly one token.")
    answer_token_id: int | None = Field(None, ge=0)
    foil_token: str | None = None
    foil_token_id: int | None = Field(None, ge=0)
    metric: Metric = "logprob"
    recovered_basis: Basis = Field(
        "logprob", description="Quantity normalised by `recovered` (the fork uses logprob).")
    logprobs: int = Field(20, ge=1, description="Accepted for fork compatibility; cells are scored exactly on the answer/foil ids.")
    clean_baseline: float | None = Field(None, description="Clean value of the basis metric, when it cannot be measured (e.g. a stored run without clean_prompt).")
    keep_source: bool = Field(False, description="Keep the auto-captured clean run (for zoom follow-ups).")
    stream: bool = Field(False, description="Stream cells as server-sent events.")
    noise: NoiseSpec | None = Field(None, description="Noise corruption of the prompt instead of a corrupt prompt.")
    subject: SpanSpec | None = Field(None, description="Subject span of the corrupt prompt, marked in figures.")
    noise_floor_samples: int = Field(6, ge=1, le=32, description="Unpatched baseline re-runs spread through the cell batch.")
    max_concurrency: int | None = Field(None, ge=1, le=4096, description="Cells in flight at once (default: as many as "
                                                                      "the engine batches, its max_num_seqs); below 1 + "
                                                                      "the noise samples, the setup's clean capture and "
                                                                      "corrupt baselines also run one at a time.")
    prefix_reuse: bool | None = Field(
        None, description="Cells (and baselines) read the corrupt prompt's KV from the prefix cache below their first "
                          "patched (or noised) position, at KV-block granularity, instead of computing the whole prompt; "
                          "what they write from there on is never shared. Default: on where a reused cell is "
                          "bit-identical to the same cell computed from scratch (the CPU engine, a GPU engine with batch "
                          "invariance on: its default) and the prompt spans two KV blocks or more, off elsewhere (short "
                          "prompts run their cells as the segments of shared requests instead: `segmented`).")

    def hook_list(self) -> list[str]:
        return list(dict.fromkeys(self.hooks)) if self.hooks else [self.hook]

    def positions_json(self) -> Any:
        if isinstance(self.positions, str):
            return self.positions
        return [p.model_dump() if isinstance(p, SpanSpec) else p for p in self.positions]


# ---- responses: the summary, the running state and the stream's events ---------------------------
def _schema_optional_keys(schema: dict[str, Any], cls: type) -> None:
    """OpenAPI: keys in `_omit_none` are absent (not null) when they have no value."""
    omitted = getattr(cls, "_omit_none", frozenset())
    if "required" in schema:
        schema["required"] = [k for k in schema["required"] if k not in omitted]


class _Wire(BaseModel):
    """Base of every response model: exact (no undeclared key), every field listed as present in
    the response schema (the server always sends them), and the keys in `_omit_none` left out of
    the JSON when None. Validating with `context={IGNORE_UNKNOWN: True}` drops keys the model does
    not declare first (a newer server's additions), at every nesting level."""

    model_config = ConfigDict(extra="forbid", json_schema_serialization_defaults_required=True,
                              json_schema_extra=_schema_optional_keys)
    #: optional keys that are absent from the JSON (rather than null) when they have no value
    _omit_none: ClassVar[frozenset[str]] = frozenset()

    @model_validator(mode="before")
    @classmethod
    def _drop_unknown_keys(cls, data: Any, info: ValidationInfo) -> Any:
        if isinstance(data, Mapping) and info.context and info.context.get(IGNORE_UNKNOWN):
            return {k: v for k, v in data.items() if k in cls.model_fields}
        return data

    @model_serializer(mode="wrap")
    def _leave_out_absent(self, handler: SerializerFunctionWrapHandler):  # no return type: the schema stays the model's
        data = handler(self)
        if self._omit_none and isinstance(data, dict):
            for key in self._omit_none:
                if key in data and data[key] is None:
                    del data[key]
        return data


#: validation-context key: drop undeclared keys instead of refusing them (reading a stream)
IGNORE_UNKNOWN = "ignore_unknown_keys"


class ArgmaxCell(_Wire):
    """The largest value of a grid (the first one on ties)."""

    layer: int
    position: int
    value: float


class HookGrid(_Wire):
    hook: str = Field(description="The hook of this grid.")
    grid: list[list[float | None]] = Field(description="`grid[i][j]` is `layers[i]` x `positions[j]`; null where no value.")
    argmax: ArgmaxCell | None = Field(None, description="The largest value; null when the grid has no value.")


class SkippedPosition(_Wire):
    """A swept position that was not run (its clean/corrupt tokens do not align)."""

    position: int
    reason: str


class VoidedCell(_Wire):
    """A cell that was run but whose patch could not be applied: its value is withdrawn (null)."""

    hook: str
    layer: int
    position: int
    reason: str


class CellRef(_Wire):
    hook: str
    layer: int
    position: int


class CellRepeat(_Wire):
    """A cell run a second time after all the others; both values in basis units."""

    hook: str
    layer: int
    position: int
    first: float
    repeat: float


class SweepAlignment(_Wire):
    """Token alignment of the clean and the corrupt prompt (see `app/sweep/alignment.py`)."""

    n_clean: int = Field(description="Tokens of the clean prompt.")
    n_corrupt: int = Field(description="Tokens of the corrupt prompt.")
    prefix_len: int = Field(description="Length of the common token prefix.")
    suffix_len: int = Field(description="Length of the common token suffix.")
    unaligned_positions: list[int] = Field(default_factory=list, description="Corrupt positions without a clean counterpart.")
    position_map: dict[str, int] = Field(default_factory=dict, description="Corrupt position (as a string) -> clean position, for every aligned position.")


class SweepSource(_Wire):
    """Where the patched values come from."""

    _omit_none = frozenset({"run_id", "name"})

    kind: Literal["run", "zeros", "vector", "inline", "mean", "module"] = Field(
        description="`run`: a clean run; `mean`: its mean over positions; `zeros`; `vector`: a registered vector; "
                    "`module`: a steering module's vector at each cell's site; `inline`: a row of `patch_vectors`.")
    run_id: str | None = Field(None, description="The stored run (kinds run and mean); absent otherwise.")
    name: str | None = Field(None, description="The module or vector name (kinds zeros, mean, vector, module, inline); absent otherwise.")


class SweepNoise(_Wire):
    """Noise corruption of the prompt (ROME-style)."""

    positions: list[int] = Field(description="Token positions that get noise.")
    scale: float = Field(description="Noise scale in units of the embedding matrix's std.")
    seed: int = Field(description="Seed of the first draw (draw k uses seed + k).")
    samples: int = Field(description="Noise draws averaged per cell.")


class WorkerChecksum(_Wire):
    tp_rank: int | None = None
    pp_rank: int | None = None
    action_checksum: str | None = Field(None, description="Rolling 64-bit checksum of the applied interventions (hex).")
    action_count: int | None = Field(None, description="Interventions applied by this worker.")


class SweepChecksum(_Wire):
    """Cross-rank determinism of the engine's interventions: ranks of one pipeline stage must have
    applied the same actions. `consistent` is null (with `error`) when the status was unavailable."""

    _omit_none = frozenset({"action_count", "mismatches", "checksums", "ranks", "workers", "error"})

    consistent: bool | None = Field(None, description="True when the ranks agree, false on a mismatch, null when unknown.")
    action_count: int | None = Field(None, description="Interventions applied (when consistent).")
    mismatches: dict[str, dict[str, str]] | None = Field(
        None, description="Pipeline stage -> {rank: checksum} for each stage whose ranks disagree (when not consistent).")
    checksums: dict[str, str] | None = Field(
        None, description="Every worker's checksum, keyed 'tp<i>/pp<k>' (when not consistent).")
    ranks: int | None = Field(None, description="Workers compared.")
    workers: list[WorkerChecksum] | None = Field(None, description="Per-worker checksum and action count.")
    error: str | None = Field(None, description="Why the status is unavailable.")


class NoiseFloorDetail(_Wire):
    """How the noise floor was measured: unpatched baselines re-run inside the cell batch, and
    cells run a second time after all the others."""

    value: float = Field(description="The noise floor: the largest deviation, in the metric's units.")
    solo: float | None = Field(None, description="The corrupt baseline run alone (basis units).")
    in_batch: list[float] = Field(default_factory=list, description="The baseline re-runs inside the batch (basis units).")
    cell_repeats: list[CellRepeat] = Field(default_factory=list, description="Cells run twice, both values (basis units).")
    units: Metric | None = Field(None, description="Units of `value` (the sweep's metric).")


class SweepSetup(_Wire):
    """What a sweep is, known before its first cell: the `start` event, and the summary's first
    fields. Fields of the reference fork's response keep its names and meanings."""

    _omit_none = frozenset({"mask"})

    sweep_id: str = Field(description="Id of the sweep (GET/DELETE /v1/patch_sweep/{sweep_id}).")
    layers: list[int] = Field(description="Row axis: the swept layers.")
    positions: list[int] = Field(description="Column axis: the swept token positions of the corrupt prompt that were run "
                                             "(unaligned ones left out, as in the fork).")
    swept_positions: list[int] | None = Field(None, description="Every requested position, unaligned ones included "
                                                                "(causalboard's full axis: their columns have no value).")
    hook: str = Field(description="The first hook (`grid` is its grid).")
    hooks: list[str] | None = Field(None, description="Every swept hook, in the request's order (`hook` is the first).")
    metric: Metric = Field(description="Unit of the values. Differs from `metric_requested` when `recovered` is undefined (see `notes`).")
    metric_requested: Metric | None = Field(None, description="The metric the request asked for.")
    recovered_basis: Basis | None = Field(None, description="Quantity `recovered` normalises; null for other metrics.")
    auto_captured: bool = Field(False, description="Whether the clean run was captured by this sweep.")
    captured_source_run: str | None = Field(None, description="Id of the auto-captured clean run (kept only when `source_kept`).")
    cells_total: int | None = Field(None, description="Cells the sweep runs: hooks x layers x aligned positions.")
    clean: float | None = Field(None, description="Clean baseline of the basis metric (null when unknown).")
    corrupt: float | None = Field(None, description="Corrupt baseline of the basis metric (mean over noise draws).")
    alignment: SweepAlignment | None = Field(None, description="Token alignment of clean and corrupt prompt; null without a clean prompt.")
    model: str | None = Field(None, description="The served model.")
    prompt: str | None = Field(None, description="The corrupt prompt.")
    clean_prompt: str | None = Field(None, description="The clean prompt (the prompt itself with noise corruption).")
    prompt_token_ids: list[int] | None = Field(None, description="Token ids of the corrupt prompt.")
    token_strings: list[str] | None = Field(None, description="Display string of each corrupt-prompt token.")
    clean_token_ids: list[int] | None = Field(None, description="Token ids of the clean prompt; null without one.")
    clean_token_strings: list[str] | None = Field(None, description="Display string of each clean-prompt token.")
    answer_token_id: int | None = Field(None, description="The scored answer token.")
    answer_token: str | None = Field(None, description="Display string of the answer token.")
    foil_token_id: int | None = Field(None, description="The foil token (logit_diff), or null.")
    foil_token: str | None = Field(None, description="Display string of the foil token, or null.")
    alpha: float | None = Field(None, description="Patch strength: (1 - alpha) * h + alpha * source.")
    source: SweepSource | None = Field(None, description="Where the patched values come from.")
    mask: dict | None = Field(None, description='The dimension mask of every cell\'s patch ({"indices": [...]} or {"weights": base64 float32}); absent without one.')
    subject_positions: list[int] = Field(default_factory=list, description="Positions of `subject` (or the noise span), marked in figures.")
    noise: SweepNoise | None = Field(None, description="Noise corruption of the prompt, or null.")
    prefix_reuse: bool | None = Field(None, description="Whether cells and baselines read the corrupt prompt's cached KV below "
                                                        "their first modified position (the request's `prefix_reuse`, else the "
                                                        "server's default).")
    segmented: bool | None = Field(None, description="Whether cells and in-batch baselines ran as the segments of shared "
                                                     "requests, several per vLLM request, with the scores of requests of "
                                                     "their own (docs/segmented-cells.md): the default for prompts shorter "
                                                     "than two KV blocks without noise, and with `prefix_reuse: false`, "
                                                     "where the engine can.")
    layer_entry: bool | None = Field(None, description="Whether the segmented cells started their forward at the lowest "
                                                       "layer they patch, from the corrupt baseline's run stored at every "
                                                       "layer, the layers below not computed, with the same scores (layer "
                                                       "skipping, docs/segmented-cells.md): segmented sweeps without noise "
                                                       "on engines that offer it (eager, one pipeline stage; by default "
                                                       "the CPU).")


class SweepSummary(SweepSetup):
    """A finished (or cancelled, or failed) sweep: the JSON body of `POST /v1/patch_sweep` and
    `GET /v1/patch_sweep/{sweep_id}`, and the last event of the stream."""

    grid: list[list[float | None]] = Field(description="The first hook's grid: `grid[i][j]` is `layers[i]` x `positions[j]`; null where no value (skipped, voided or not run).")
    argmax: ArgmaxCell | None = Field(None, description="The first hook's largest value, or null.")
    hook_grids: list[HookGrid] | None = Field(None, description="One grid per hook when the request gave `hooks` (even one); null when it gave `hook` (as in the fork).")
    skipped: list[SkippedPosition | VoidedCell] = Field(
        default_factory=list, description="Unaligned positions (not run) and voided cells (value null), each with its reason.")
    noise_floor: float | None = Field(None, description="The noise floor in the metric's units; null when not measured.")
    noise_floor_detail: NoiseFloorDetail | None = Field(None, description="How the noise floor was measured.")
    within_noise: list[CellRef] = Field(
        default_factory=list, description="Cells whose effect (|value - corrupt|; |value| for recovered) is within the noise floor.")
    within_noise_threshold: float | None = Field(None, description="The threshold `within_noise` used: max(noise floor, 1e-6).")
    source_kept: bool | None = Field(None, description="Whether the auto-captured clean run is still stored (keep_source).")
    checksum: SweepChecksum | None = Field(None, description="The last checksum status of the sweep.")
    cells_done: int | None = Field(None, description="Cells that completed (voided ones included).")
    cells_voided: int | None = Field(None, description="Cells whose patch could not be applied.")
    elapsed_s: float | None = Field(None, description="Seconds from planning to the summary.")
    reused_prompt_tokens: int | None = Field(None, description="Prompt tokens the cells and baselines read from the prefix "
                                                               "cache instead of computing them (0 without `prefix_reuse`).")
    cancelled: bool = Field(False, description="Whether the sweep stopped before every cell ran (cancel, disconnect or failure).")
    notes: list[str] = Field(default_factory=list, description="Caveats (e.g. recovered undefined, batch-dependent numerics).")
    versions: dict[str, str] = Field(default_factory=dict, description="Versions of the server's components.")


class SweepStatus(_Wire):
    """`GET /v1/patch_sweep/{sweep_id}` while the sweep has no summary yet."""

    sweep_id: str
    state: Literal["preparing", "running", "done", "cancelled", "failed"]
    cells_total: int
    cells_done: int = Field(description="Cells completed so far.")
    elapsed_s: float


# ---- the stream's events (`data:` of each SSE event; then `data: [DONE]`) ------------------------
class _StartTag(_Wire):
    type: Literal["start"] = "start"


class _ChecksumTag(_Wire):
    type: Literal["checksum"] = "checksum"


class _NoiseFloorTag(_Wire):
    type: Literal["noise_floor"] = "noise_floor"


class _SummaryTag(_Wire):
    type: Literal["summary"] = "summary"


class StartEvent(SweepSetup, _StartTag):
    """First: the sweep's axes, baselines, tokens, alignment and source."""


class WarningEvent(_Wire):
    """A caveat (also in the summary's `notes`)."""

    type: Literal["warning"] = "warning"
    message: str


class SkipEvent(_Wire):
    """One per unaligned swept position (not run)."""

    type: Literal["skip"] = "skip"
    position: int
    reason: str


class ChecksumEvent(SweepChecksum, _ChecksumTag):
    """After `start` and before the summary: the engine's determinism status."""


class CellEvent(_Wire):
    """A completed cell (in completion order), or a voided one: `value` null with `error`."""

    _omit_none = frozenset({"error", "raw"})

    type: Literal["cell"] = "cell"
    hook: str | None = Field(None, description="The cell's hook (the first hook when absent).")
    layer: int
    position: int
    value: float | None = Field(description="The value in the metric's units; null when voided.")
    error: str | None = Field(None, description="Why the cell was voided; absent otherwise.")
    raw: float | None = Field(None, description="The value of the basis metric; absent for a voided cell.")


class NoiseFloorEvent(NoiseFloorDetail, _NoiseFloorTag):
    """As baseline re-runs and repeated cells complete: the noise floor so far."""

    final: bool = Field(False, description="Whether every re-run has completed.")


class ProgressEvent(_Wire):
    """Every 0.5 s and at the last cell."""

    type: Literal["progress"] = "progress"
    done: int = Field(description="Cells completed.")
    total: int = Field(description="Cells the sweep runs.")
    voided: int = Field(0, description="Cells voided so far.")
    elapsed_s: float | None = Field(None, description="Seconds since the sweep was planned.")
    cells_per_s: float | None = Field(None, description="Completed cells per second.")


class ErrorEvent(_Wire):
    """The sweep failed (the summary that follows has what was done)."""

    type: Literal["error"] = "error"
    error: str


class SummaryEvent(SweepSummary, _SummaryTag):
    """Last: the summary (the JSON answer of a non-streamed sweep)."""


SweepEventModel = Union[StartEvent, WarningEvent, SkipEvent, ChecksumEvent, CellEvent, NoiseFloorEvent, ProgressEvent,
                        ErrorEvent, SummaryEvent]
#: one event of the stream, discriminated by `type`
SweepEvent = Annotated[SweepEventModel, Field(discriminator="type")]
SWEEP_EVENT: TypeAdapter[SweepEventModel] = TypeAdapter(SweepEvent)
#: every event type this version knows
EVENT_TYPES = ("start", "warning", "skip", "checksum", "cell", "noise_floor", "progress", "error", "summary")


class SweepEventError(ValueError):
    """A malformed event: `field` names the offending key (dotted path), `message` what is wrong."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message


def parse_event(data: Mapping[str, Any] | SweepEventModel) -> SweepEventModel | None:
    """The typed event of one decoded `data:` object (a model is returned as is). None for an
    event type this version does not know (to be ignored); keys it does not know are dropped.
    Raises `SweepEventError` naming the field when a known event is malformed."""
    if isinstance(data, get_args(SweepEventModel)):
        return data
    if not isinstance(data, Mapping):
        raise SweepEventError("event", f"must be a JSON object, got {type(data).__name__}")
    kind = data.get("type")
    if kind is None:
        raise SweepEventError("type", "missing: every event names its type")
    if kind not in EVENT_TYPES:
        return None
    try:
        return SWEEP_EVENT.validate_python(data, context={IGNORE_UNKNOWN: True})
    except ValidationError as exc:
        err = exc.errors()[0]
        # loc: the event type (the union's tag), then field names, list indices and, inside a
        # union of models, the chosen model's class name (left out here)
        where = ".".join(str(p) for p in err["loc"][1:] if not (isinstance(p, str) and isinstance(globals().get(p), type)))
        raise SweepEventError(f"{kind}.{where}" if where else str(kind), err["msg"]) from None


def event_json_schema() -> dict[str, Any]:
    """JSON Schema of one event (as serialized), self-contained (no `$ref`): for the
    `text/event-stream` content of the sweep routes' OpenAPI."""
    schema = SWEEP_EVENT.json_schema(mode="serialization")
    defs = schema.pop("$defs", {})
    schema.pop("discriminator", None)  # its mapping points into $defs; each variant's `type` is a const

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if ref is not None:
                return inline(defs[ref.rsplit("/", 1)[-1]])
            return {k: inline(v) for k, v in node.items()}
        if isinstance(node, list):
            return [inline(v) for v in node]
        return node

    return {"title": "SweepEvent", "description": "One `data:` object of the sweep's event stream; the stream ends with `data: [DONE]`.",
            **inline(schema)}

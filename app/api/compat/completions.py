"""The reference fork's per-request fields on `/v1/completions`, turned into one `Interventions`.

| fork field | becomes |
| --- | --- |
| `steering_vectors` / `prefill_steering_vectors` / `decode_steering_vectors` | single-site `Steer` entries at every position of phase both / prefill / decode |
| `steering_name` | the module's vectors (`app/api/compat/steering_modules.py`), scale 1 |
| `patch[i]` (`layer`, `hook`, `dest_position`, one source, `alpha`) | a one-position `Patch`: `source_run` (+ `source_position`, default the destination) -> stored run; `source_module` -> `"zeros"`, a module's both-phase vector at the site, or a named vector; `source_inline` -> row of `patch_vectors` |
| `logprob_token_ids` | `score_token_ids` (exact scoring); `logprobs` must be omitted or equal their count (the fork's rule) |
| `capture: {"patch_source": {"run", "hooks", "positions"}}` | a `Capture` kept as `run` (values not returned) |

They compose with the native `interventions` field (steer and patch entries are concatenated;
capture and scoring may come from one side only). Fork fields with no faithful counterpart
(clamps, declarative `steering` gates, `conversation_id`, other capture consumers) are refused with a 400 naming the field. Engine errors about the combined spec are
re-labelled with the request field the entry came from (`patch[1].dest_position`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine_ext import Engine
from engine_ext.errors import SpecError
from engine_ext.specs import Capture, Interventions, Patch, RunSource, InlineSource, ZeroSource, mask_from_json
from engine_ext.sites import Site

from app.api.compat import steering_modules
from app.api.field_names import by_index, by_prefix
from app.api.compat.fork_vectors import check_hook, check_layer, parse_patch_vectors, parse_vector_spec
from app.api.schemas.generation import CompletionRequest

UNSUPPORTED_FIELDS = ("steering_clamps", "prefill_steering_clamps", "decode_steering_clamps", "steering", "conversation_id")
TIERS = {"steering_vectors": "both", "prefill_steering_vectors": "prefill", "decode_steering_vectors": "decode"}


@dataclass
class CompletionInterventions:
    """The combined spec plus what is needed to name fields and shape the response."""

    spec: Interventions
    steer_origins: list[str] = field(default_factory=list)
    patch_origins: list[str] = field(default_factory=list)
    capture_origin: str = "interventions.capture"
    score_origin: str = "interventions.score_token_ids"
    fork_capture_run: str | None = None
    n_native_patches: int = 0
    #: some intervention (native or fork) was asked for: the response carries `intervention`
    requested: bool = False

    def keeps_source(self) -> bool:
        return self.spec.capture is not None and self.spec.capture.keep_as is not None

    def relabel(self, exc: SpecError) -> SpecError:
        """An engine SpecError about the combined spec -> the request field it came from."""
        exc = by_index(exc, "steer", self.steer_origins)
        n = self.n_native_patches
        exc = by_index(exc, "patch", self.patch_origins[:n])
        exc = by_index(exc, "patch", self.patch_origins[n:], offset=n, suffix=_fork_patch_suffix)
        capture_map = ({"capture.positions": "capture.patch_source.positions", "capture.sites": "capture.patch_source.hooks"}
                       if self.fork_capture_run is not None else {"capture": self.capture_origin})
        return by_prefix(exc, {**capture_map, "noise": "interventions.noise", "score_token_ids": self.score_origin})


def _fork_patch_suffix(rest: str) -> str:
    if rest.startswith(".source.positions"):
        return ".source_position"
    if rest.startswith(".positions"):
        return ".dest_position"
    if rest.startswith(".site"):
        return ".layer"
    return rest


def build(req: CompletionRequest, eng: Engine) -> CompletionInterventions:
    """Validate the fork fields and the native `interventions` of `req` into one spec."""
    for name in UNSUPPORTED_FIELDS:
        if getattr(req, name) is not None:
            raise SpecError(name, "is not supported by causalboard (the request is refused rather than run without it)")
    info = eng.info
    native = req.interventions.to_spec("interventions") if req.interventions is not None else Interventions()
    out = CompletionInterventions(spec=native, requested=req.interventions is not None)
    steers = list(native.steer)
    out.steer_origins = [f"interventions.steer[{k}]" for k in range(len(native.steer))]
    for tier, phase in TIERS.items():
        for s in parse_vector_spec(getattr(req, tier), tier, phase=phase, num_layers=info.num_layers, hidden=info.hidden_size):
            steers.append(s)
            out.steer_origins.append(f"{tier}.{s.sites[0].hook}.{s.sites[0].layer}")
    if req.steering_name is not None:
        for s in steering_modules.steers_of(eng, req.steering_name, "steering_name"):
            steers.append(s)
            out.steer_origins.append("steering_name")
    patches = list(native.patch)
    out.patch_origins = [f"interventions.patch[{k}]" for k in range(len(native.patch))]
    out.n_native_patches = len(native.patch)
    table = parse_patch_vectors(req.patch_vectors.model_dump() if req.patch_vectors else None, "patch_vectors", hidden=info.hidden_size)
    for i, entry in enumerate(req.patch or []):
        patches.append(_fork_patch(entry, f"patch[{i}]", eng, table))
        out.patch_origins.append(f"patch[{i}]")
    capture = native.capture
    if req.capture is not None:
        if capture is not None:
            raise SpecError("capture", "give the capture either here or in interventions.capture, not both")
        capture = _fork_capture(req.capture, info.num_layers)
        out.fork_capture_run = capture.keep_as
    score = native.score_token_ids
    if req.logprob_token_ids is not None:
        if score:
            raise SpecError("logprob_token_ids", "give the scored ids either here or in interventions.score_token_ids, not both")
        ids = req.logprob_token_ids
        if not ids:
            raise SpecError("logprob_token_ids", "must name at least one token id")
        if req.logprobs is not None and req.logprobs != len(ids):
            raise SpecError("logprobs", f"with logprob_token_ids, logprobs must be omitted or equal their count ({len(ids)})")
        score = tuple(ids)
        out.score_origin = "logprob_token_ids"
    out.spec = Interventions(tuple(steers), tuple(patches), capture, native.noise, tuple(score))
    out.requested = out.requested or not out.spec.is_empty()
    return out


def _fork_mask(value, f: str, table):
    """The fork's `mask`: `{"indices": [...]}`, or `{"inline": row}` (a row of `patch_vectors`,
    graded weights in [0, 1]); causalboard's other mask forms are accepted too."""
    if isinstance(value, dict) and "inline" in value:
        row = value["inline"]
        if set(value) != {"inline"}:
            raise SpecError(f"{f}.mask", "give exactly one of 'indices' and 'inline'")
        if not isinstance(row, int) or isinstance(row, bool) or row < 0:
            raise SpecError(f"{f}.mask.inline", f"must be a row index >= 0, got {row!r}")
        if table is None:
            raise SpecError(f"{f}.mask.inline", "needs the patch_vectors table")
        if row >= table.shape[0]:
            raise SpecError(f"{f}.mask.inline", f"row {row} is outside patch_vectors ({table.shape[0]} rows)")
        return mask_from_json({"weights": table[row]}, f"{f}.mask")
    return mask_from_json(value, f"{f}.mask")


def _fork_patch(entry, f: str, eng: Engine, table) -> Patch:
    mask = _fork_mask(entry.mask, f, table) if entry.mask is not None else None
    if mask is not None:
        mask.values(eng.info.hidden_size, f"{f}.mask")
    hook = check_hook(entry.hook, f"{f}.hook")
    layer = check_layer(entry.layer, f"{f}.layer", eng.info.num_layers)
    site = Site(layer, hook)
    given = [k for k in ("source_run", "source_module", "source_inline") if getattr(entry, k) is not None]
    if len(given) != 1:
        raise SpecError(f, f"give exactly one of source_run, source_module, source_inline (got {', '.join(given) or 'none'})")
    if entry.source_position is not None and entry.source_run is None:
        raise SpecError(f"{f}.source_position", "only applies with source_run")
    if not math.isfinite(entry.alpha):
        raise SpecError(f"{f}.alpha", f"must be a finite number, got {entry.alpha!r}")
    if entry.source_run is not None:
        src_pos = entry.source_position if entry.source_position is not None else entry.dest_position
        source = RunSource(entry.source_run, (src_pos,))
    elif entry.source_module is not None:
        if entry.source_module in ("zeros", "zero"):
            source = ZeroSource()
        else:
            vec = steering_modules.source_vector(eng, entry.source_module, site)
            if vec is None:
                raise SpecError(f"{f}.source_module", f"{entry.source_module!r} is neither 'zeros', a steering module with a "
                                                      f"vector at {site}, nor a registered vector")
            source = InlineSource((vec,))
    else:
        if table is None:
            raise SpecError(f"{f}.source_inline", "needs the patch_vectors table")
        if entry.source_inline >= table.shape[0]:
            raise SpecError(f"{f}.source_inline", f"row {entry.source_inline} is outside patch_vectors ({table.shape[0]} rows)")
        source = InlineSource((table[entry.source_inline],))
    return Patch(site, (entry.dest_position,), source, float(entry.alpha), mask)


def _fork_capture(value: dict, num_layers: int) -> Capture:
    """`{"patch_source": {"run", "hooks": {hook: "all" | [layers] | {"layers": [...]}}, "positions"}}`."""
    extra = sorted(set(value) - {"patch_source"})
    if extra:
        raise SpecError(f"capture.{extra[0]}", "capture consumer not supported by causalboard (only patch_source)")
    spec = value.get("patch_source")
    f = "capture.patch_source"
    if not isinstance(spec, dict):
        raise SpecError(f, "must be an object {run, hooks, positions}")
    unknown = sorted(set(spec) - {"run", "hooks", "positions"})
    if unknown:
        raise SpecError(f"{f}.{unknown[0]}", "unknown or unsupported field")
    run = spec.get("run")
    if not isinstance(run, str) or not run:
        raise SpecError(f"{f}.run", "must be the id to store the run under")
    hooks = spec.get("hooks")
    if not isinstance(hooks, dict) or not hooks:
        raise SpecError(f"{f}.hooks", "must be {hook: 'all' | [layers]}")
    sites = []
    for hook, layers in hooks.items():
        hf = f"{f}.hooks.{hook}"
        check_hook(hook, hf)
        if isinstance(layers, dict):
            if set(layers) - {"layers"}:
                raise SpecError(f"{hf}.{sorted(set(layers) - {'layers'})[0]}", "not supported by causalboard (list the layers)")
            layers = layers.get("layers")
        if layers == "all":
            layers = list(range(num_layers))
        if not isinstance(layers, list) or not layers:
            raise SpecError(hf, "must be 'all' or a non-empty list of layers")
        sites += [Site(check_layer(x, f"{hf}[{k}]", num_layers), hook) for k, x in enumerate(layers)]
    try:
        return Capture.make(sites, spec.get("positions", "all_prompt"), keep_as=run, return_values=False, field_name=f)
    except SpecError as exc:
        raise by_prefix(exc, {f"{f}.keep_as": f"{f}.run", f"{f}.sites": f"{f}.hooks"}) from None

"""The reference fork's per-request fields on `/v1/completions`, turned into one `Interventions`.

| fork field | becomes |
| --- | --- |
| `steering_vectors` / `prefill_steering_vectors` / `decode_steering_vectors` | single-site `Steer` entries at every position of phase both / prefill / decode |
| `steering_name` | the module's vectors (`app/fork/steering_modules.py`), scale 1, and its clamps (before the inline ones) |
| `patch[i]` (`layer`, `hook`, `dest_position`, one source, `alpha`) | a one-position `Patch`: `source_run` (+ `source_position`, default the destination) -> stored run; `source_module` -> `"zeros"`, a module's both-phase vector at the site, or a named vector; `source_inline` -> row of `patch_vectors` |
| `logprob_token_ids` | `score_token_ids` (exact scoring); `logprobs` must be set (the fork's rule over HTTP) |
| `capture: {"patch_source": {"run"?, "hooks", "positions"}}` | a `Capture` kept as `run` (default: the completion id; values not returned) |
| `steering_clamps` / `prefill_steering_clamps` / `decode_steering_clamps` | single-site `Clamp` entries at every position of phase both / prefill / decode (`app/fork/clamps.py`) |
| `steering` (declarative gates) | `engine_ext.dynamic.gates.Gate`s (`app/fork/gates.py`), run by dynamic steering with the request's own static decode steering as what `attenuate` damps (`app/api/compat/gates.py` adds a conversation's latch) |

They compose with the native `interventions` field (steer and patch entries are concatenated;
capture and scoring may come from one side only). Fork fields with no faithful counterpart
(the `post_mlp` hook, capture consumers this server does not run, `clamp` gates) are refused
with a 400 naming the field. Engine errors about the combined spec are
re-labelled with the request field the entry came from (`patch[1].dest_position`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine_ext import Engine
from engine_ext.dynamic.gates import Gate, SiteVectors
from engine_ext.errors import SpecError
from engine_ext.specs import Capture, Interventions, Patch, RunSource, InlineSource, ZeroSource
from engine_ext.sites import Site

from app.fork import steering_modules
from app.fork.clamps import COMPLETION_TIERS, parse_tiers
from app.fork.gates import Resolver, parse_gates, static_decode
from app.api.compat.capture_files import LAYOUTS, FileCapture, slug
from app.fork.masks import fork_mask
from app.api.field_names import by_index, by_prefix
from app.fork.vectors import check_hook, check_layer, parse_patch_vectors, parse_vector_spec
from app.api.schemas.generation import CompletionRequest

#: the fork's cap on logprob_token_ids (its sampler's row width)
MAX_LOGPROB_TOKEN_IDS = 128
TIERS = {"steering_vectors": "both", "prefill_steering_vectors": "prefill", "decode_steering_vectors": "decode"}


@dataclass
class CompletionInterventions:
    """The combined spec plus what is needed to name fields and shape the response."""

    spec: Interventions
    steer_origins: list[str] = field(default_factory=list)
    clamp_origins: list[str] = field(default_factory=list)
    n_native_clamps: int = 0
    patch_origins: list[str] = field(default_factory=list)
    capture_origin: str = "interventions.capture"
    score_origin: str = "interventions.score_token_ids"
    fork_capture_run: str | None = None
    #: the fork's filesystem consumer, when requested
    file_capture: FileCapture | None = None
    #: the capture came from the fork's `capture` field (its field names label errors)
    fork_capture: bool = False
    n_native_patches: int = 0
    #: some intervention (native or fork) was asked for: the response carries `intervention`
    requested: bool = False
    #: the fork's declarative gates (None: none) and the request's static decode steering
    gates: list[Gate] | None = None
    static_decode: SiteVectors | None = None

    def keeps_source(self) -> bool:
        return self.spec.capture is not None and self.spec.capture.keep_as is not None

    def relabel(self, exc: SpecError) -> SpecError:
        """An engine SpecError about the combined spec -> the request field it came from."""
        exc = by_index(exc, "steer", self.steer_origins)
        k = self.n_native_clamps
        exc = by_index(exc, "clamp", self.clamp_origins[:k])
        exc = by_index(exc, "clamp", self.clamp_origins[k:], offset=k,
                       suffix=lambda rest: "" if rest.startswith(".sites") else rest)
        n = self.n_native_patches
        exc = by_index(exc, "patch", self.patch_origins[:n])
        exc = by_index(exc, "patch", self.patch_origins[n:], offset=n, suffix=_fork_patch_suffix)
        consumer = "capture.patch_source" if self.fork_capture_run is not None else "capture.filesystem"
        capture_map = ({"capture.positions": f"{consumer}.positions", "capture.sites": f"{consumer}.hooks"}
                       if self.fork_capture else {"capture": self.capture_origin})
        return by_prefix(exc, {**capture_map, "noise": "interventions.noise", "score_token_ids": self.score_origin})


def _fork_patch_suffix(rest: str) -> str:
    if rest.startswith(".source.positions"):
        return ".source_position"
    if rest.startswith(".positions"):
        return ".dest_position"
    if rest.startswith(".site"):
        return ".layer"
    return rest


def build(req: CompletionRequest, eng: Engine, default_run: str = "", capture_dir: str | None = None,
          resolve: Resolver | None = None) -> CompletionInterventions:
    """Validate the fork fields and the native `interventions` of `req` into one spec
    (`default_run`: the run id of a `patch_source` capture without `run`, the fork's request id;
    `resolve`: the fork registry's lookup for the gates' named vectors)."""
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
    clamps = list(native.clamp)
    out.clamp_origins = [f"interventions.clamp[{k}]" for k in range(len(native.clamp))]
    out.n_native_clamps = len(native.clamp)
    fork_clamps, origins = [], []
    if req.steering_name is not None:  # the module's clamps come before the inline ones (the fork's order)
        fork_clamps = steering_modules.clamps_of(eng, req.steering_name)
        origins = ["steering_name"] * len(fork_clamps)
    more, more_origins = parse_tiers(req, COMPLETION_TIERS, num_layers=info.num_layers, hidden=info.hidden_size)
    fork_clamps, origins = fork_clamps + more, origins + more_origins
    clamps += fork_clamps
    out.clamp_origins += origins
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
        capture, out.fork_capture_run, out.file_capture = _fork_capture(req.capture, info.num_layers, default_run, capture_dir)
        out.fork_capture = True
    score = native.score_token_ids
    if req.logprob_token_ids:  # the fork: an empty list is no list
        if score:
            raise SpecError("logprob_token_ids", "give the scored ids either here or in interventions.score_token_ids, not both")
        ids = req.logprob_token_ids
        if req.logprobs is None:
            raise SpecError("logprob_token_ids", "when using logprob_token_ids, logprobs must be set (the fork's rule)")
        if len(ids) > MAX_LOGPROB_TOKEN_IDS:
            raise SpecError("logprob_token_ids", f"{len(ids)} ids; at most {MAX_LOGPROB_TOKEN_IDS}")
        score = tuple(ids)
        out.score_origin = "logprob_token_ids"
    out.spec = Interventions(tuple(steers), tuple(patches), capture, native.noise, tuple(score), tuple(clamps))
    out.gates = parse_gates(req.steering, resolve or (lambda name, kind: None), num_layers=info.num_layers,
                            hidden=info.hidden_size)
    if out.gates:
        out.static_decode = static_decode(steers)
    out.requested = out.requested or not out.spec.is_empty() or bool(out.gates)
    return out


def _fork_patch(entry, f: str, eng: Engine, table) -> Patch:
    mask = fork_mask(entry.mask, f"{f}.mask", table=table, hidden=eng.info.hidden_size) if entry.mask is not None else None
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


def _hook_sites(hooks: object, f: str, num_layers: int) -> list[Site]:
    """`{hook: "all" | [layers] | {"layers", "ranges"}}` -> sites (ranges are inclusive pairs)."""
    if not isinstance(hooks, dict) or not hooks:
        raise SpecError(f, "must be {hook: 'all' | [layers] | {'layers', 'ranges'}}")
    sites = []
    for hook, layers in hooks.items():
        hf = f"{f}.{hook}"
        check_hook(hook, hf)
        if isinstance(layers, dict):
            layers = _layer_selector(layers, hf, num_layers)
        if layers == "all":
            layers = list(range(num_layers))
        if not isinstance(layers, list) or not layers:
            raise SpecError(hf, "must be 'all' or a non-empty list of layers")
        sites += [Site(check_layer(x, f"{hf}[{k}]", num_layers), hook) for k, x in enumerate(layers)]
    return sites


def _fork_capture(value: dict, num_layers: int, default_run: str, capture_dir: str | None) -> tuple[Capture, str | None, FileCapture | None]:
    """The fork's capture consumers as one engine `Capture`, the patch_source run id (or None)
    and the filesystem request (or None):

    * `{"patch_source": {"run"?, "hooks", "positions"}}` — a stored source run (`run` defaults to
      `default_run`, the fork's request id);
    * `{"filesystem": {"request_id"?, "tag"?, "hooks", "positions", "layout"?}}` — files under
      `capture_dir` (`app/api/compat/capture_files.py`); only when the server has one.

    Both together must capture the same positions (one capture per request)."""
    consumers = ("patch_source", "filesystem") if capture_dir else ("patch_source",)
    extra = sorted(set(value) - set(consumers))
    if extra:
        # the fork answers a consumer name the server did not register with a 400 as well
        hint = " (the filesystem consumer needs a capture directory: causalboard serve --capture-dir DIR or CAUSALBOARD_CAPTURE_DIR)" if extra[0] == "filesystem" else ""
        raise SpecError(f"capture.{extra[0]}", f"no capture consumer {extra[0]!r} on this server "
                                               f"(available: {', '.join(consumers)}){hint}")
    if not value:
        raise SpecError("capture", "name at least one capture consumer")
    run = fc = None
    sites: list[Site] = []
    positions: list = []
    if "patch_source" in value:
        spec, f = value["patch_source"], "capture.patch_source"
        if not isinstance(spec, dict):
            raise SpecError(f, "must be an object {run, hooks, positions}")
        unknown = sorted(set(spec) - {"run", "hooks", "positions"})
        if unknown:
            raise SpecError(f"{f}.{unknown[0]}", "unknown or unsupported field")
        run = spec.get("run", default_run) or default_run
        if not isinstance(run, str) or not run:
            raise SpecError(f"{f}.run", "must be the id to store the run under")
        sites += _hook_sites(spec.get("hooks"), f"{f}.hooks", num_layers)
        pos = spec.get("positions", "all_prompt")
        if pos in ("all", "all_generated"):
            raise SpecError(f"{f}.positions", "patch_source captures prompt positions only (all_prompt, last_prompt or indices)")
        positions.append((f, pos))
    if "filesystem" in value:
        spec, f = value["filesystem"], "capture.filesystem"
        if not isinstance(spec, dict):
            raise SpecError(f, "must be an object {request_id, tag, hooks, positions, layout}")
        unknown = sorted(set(spec) - {"request_id", "tag", "hooks", "positions", "layout"})
        if unknown:
            raise SpecError(f"{f}.{unknown[0]}", "unknown field")
        layout = spec.get("layout") or "per_file"
        if layout not in LAYOUTS:
            raise SpecError(f"{f}.layout", f"{layout!r} is not provided here (layouts: {', '.join(LAYOUTS)})")
        fc = FileCapture(slug(spec.get("request_id", default_run), f"{f}.request_id"), slug(spec.get("tag", "default"), f"{f}.tag"),
                         _hook_sites(spec.get("hooks"), f"{f}.hooks", num_layers), layout)
        sites += fc.sites
        positions.append((f, spec.get("positions", "last_prompt")))
    if len(positions) == 2 and positions[0][1] != positions[1][1]:
        raise SpecError("capture.filesystem.positions", "must equal capture.patch_source.positions (one capture per request)")
    f, pos = positions[0]
    try:
        cap = Capture.make(list(dict.fromkeys(sites)), pos, keep_as=run, return_values=fc is not None, field_name=f)
    except SpecError as exc:
        raise by_prefix(exc, {f"{f}.keep_as": f"{f}.run", f"{f}.sites": f"{f}.hooks"}) from None
    return cap, run, fc


def _layer_selector(sel: dict, f: str, num_layers: int) -> list[int]:
    """`{"layers": [...], "ranges": [[start, end], ...]}` (inclusive ranges) -> sorted layers."""
    unknown = sorted(set(sel) - {"layers", "ranges"})
    if unknown:
        raise SpecError(f"{f}.{unknown[0]}", "unknown key (expected layers and/or ranges)")
    if sel.get("layers") is None and sel.get("ranges") is None:
        raise SpecError(f, "set layers and/or ranges")
    out = list(sel.get("layers") or [])
    if not isinstance(out, list):
        raise SpecError(f"{f}.layers", "must be a list of layers")
    ranges = sel.get("ranges") or []
    if not isinstance(ranges, list):
        raise SpecError(f"{f}.ranges", "must be a list of [start, end] pairs")
    for k, pair in enumerate(ranges):
        rf = f"{f}.ranges[{k}]"
        if (not isinstance(pair, list) or len(pair) != 2
                or not all(isinstance(x, int) and not isinstance(x, bool) for x in pair)):
            raise SpecError(rf, f"must be a [start, end] pair of integers, got {pair!r}")
        start, end = pair
        if start > end:
            raise SpecError(rf, f"start > end ({start} > {end})")
        if start < 0 or end >= num_layers:
            raise SpecError(rf, f"[{start}, {end}] is out of range: the model has layers 0..{num_layers - 1}")
        out.extend(range(start, end + 1))
    return sorted(set(out))

"""`SweepPlan`: a validated `PatchSweepRequest` resolved against the served model — token ids,
answer/foil ids, layer and position axes, alignment, the patch source and one `SweepCell` per
(hook, layer, aligned position). Everything that can be refused is refused here, before any
request reaches the engine (`SpecError` naming the field → HTTP 400; `PlanError` for other
statuses).
"""

from __future__ import annotations

import math
import re
import uuid
from dataclasses import dataclass, field

import numpy as np

from engine_ext import Engine, GenerationParams
from engine_ext.errors import SpecError
from engine_ext.specs import InlineSource, Mask, MeanSource, Noise, Patch, RunSource, ZeroSource
from engine_ext.sites import HOOKS, Site

from app.sweep.alignment import UNALIGNED_REASON, Alignment, align_positions
from app.sweep.schema import LayerRange, PatchSweepRequest


class PlanError(Exception):
    """A refusal with a status other than 400 (404 unknown run/model, 507 store too small)."""

    def __init__(self, status: int, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.status, self.field, self.message = status, field, message


@dataclass(frozen=True)
class SweepCell:
    """One patched request: patch `hook` of `layer` at corrupt `position` (from clean
    `source_position` when the source is a run)."""

    hook: str
    layer: int
    position: int
    source_position: int | None = None

    @property
    def key(self) -> tuple[str, int, int]:
        return (self.hook, self.layer, self.position)


@dataclass
class SourcePlan:
    """Where patched values come from. kind: run | zeros | mean | vector (one registered vector
    at every cell) | module (a steering module's vector at each cell's own site) | inline (a row
    of the request's `patch_vectors`)."""

    kind: str
    run_id: str | None = None
    name: str | None = None
    vector: np.ndarray | None = None
    #: kind module: (layer, hook) -> the module's both-phase vector there
    site_vectors: dict[tuple[int, str], np.ndarray] | None = None
    #: the clean run must be captured first (under `run_id`)
    capture: bool = False
    #: sites (flat indices) the capture must hold
    capture_sites: tuple[int, ...] = ()

    def to_json(self) -> dict:
        out: dict = {"kind": self.kind}
        if self.run_id is not None:
            out["run_id"] = self.run_id
        if self.name is not None:
            out["name"] = self.name
        return out


@dataclass
class SweepPlan:
    sweep_id: str
    request: PatchSweepRequest
    corrupt_ids: list[int]
    clean_ids: list[int] | None
    answer_id: int
    foil_id: int | None
    layers: list[int]
    positions: list[int]
    hooks: list[str]
    alignment: Alignment | None
    skipped_positions: list[dict]
    cells: list[SweepCell]
    source: SourcePlan
    noise_positions: list[int] | None
    subject_positions: list[int] = field(default_factory=list)
    #: the dimension mask of every cell's patch (None: every dimension): the fork's `mask`
    mask: Mask | None = None

    @property
    def run_positions(self) -> list[int]:
        """The swept positions that are run (unaligned ones left out): the wire's `positions`."""
        skipped = {s["position"] for s in self.skipped_positions}
        return [p for p in self.positions if p not in skipped]

    @property
    def metric(self) -> str:
        return self.request.metric

    @property
    def basis(self) -> str:
        m = self.request.metric
        return self.request.recovered_basis if m == "recovered" else m

    @property
    def score_ids(self) -> tuple[int, ...]:
        return (self.answer_id,) if self.foil_id is None else (self.answer_id, self.foil_id)

    @property
    def noise_samples(self) -> int:
        return self.request.noise.samples if self.request.noise else 1

    def noise_for(self, sample: int) -> Noise | None:
        """The noise spec of draw `sample` (seed + sample), or None without noise corruption."""
        nz = self.request.noise
        if nz is None:
            return None
        return Noise(tuple(self.noise_positions or ()), nz.scale, nz.seed + sample)

    def patch_for(self, cell: SweepCell) -> Patch:
        site = Site(cell.layer, cell.hook)
        src = self.source
        if src.kind == "run":
            source = RunSource(src.run_id, (cell.source_position,))
        elif src.kind == "mean":
            source = MeanSource(src.run_id)
        elif src.kind in ("vector", "inline"):
            source = InlineSource((src.vector,))
        elif src.kind == "module":
            source = InlineSource((src.site_vectors[(cell.layer, cell.hook)],))
        else:
            source = ZeroSource()
        return Patch(site, (cell.position,), source, self.request.alpha, self.mask)

    def basis_of(self, scores: dict[int, float]) -> float:
        """The basis metric of one scored request."""
        lp = scores[self.answer_id]
        if self.basis == "logprob":
            return lp
        if self.basis == "prob":
            return math.exp(lp)
        return lp - scores[self.foil_id]


def build_plan(engine: Engine, req: PatchSweepRequest, source_exists: dict[str, dict | None]) -> SweepPlan:
    """Resolve `req` against `engine` (tokenizer, model size, registered vectors).
    `source_exists` maps a requested `source_run` to `Engine.source_info` (looked up by the
    caller off the event loop). Raises SpecError / PlanError."""
    info = engine.info
    if req.model is not None and req.model not in (info.model, info.model_path):
        raise PlanError(404, "model", f"'{req.model}' is not served here (serving '{info.model}')")
    if req.patch_vectors is not None and req.source_inline is None and not (isinstance(req.mask, dict) and "inline" in req.mask):
        raise SpecError("patch_vectors", "is only used with source_inline or a mask's inline row")
    given = [k for k in ("source_module", "source_inline") if getattr(req, k) is not None]
    if len(given) > 1:
        raise SpecError("source_inline", "set exactly one of source_module / source_inline")
    if req.source_inline is not None:
        for name in ("source_run", "clean_prompt", "noise"):
            if getattr(req, name) is not None:
                raise SpecError(name, "cannot be combined with source_inline (a vector-sourced sweep has no clean run)")

    if req.source_run is not None and not re.fullmatch(r"[\w.\-:]{1,100}", req.source_run):
        raise SpecError("source_run", "must be 1-100 characters of letters, digits, '_', '-', '.', ':'")
    hooks = req.hook_list()
    field_name = "hooks" if req.hooks else "hook"
    for k, h in enumerate(hooks):
        if h not in HOOKS:
            raise SpecError(f"{field_name}[{k}]" if req.hooks else "hook",
                            f"unknown hook {h!r}; expected one of {', '.join(HOOKS)}")
    hooks = list(dict.fromkeys(hooks))  # the request's order (the fork's): `grid` is the first hook's

    layers = _layers(req.layers, info.num_layers)

    corrupt_ids = engine.tokenize(req.prompt)
    engine.validate(corrupt_ids, GenerationParams(max_tokens=1))  # context length
    answer_id = _token_id(engine, req.answer_token, req.answer_token_id, "answer_token", required=True)
    foil_id = _token_id(engine, req.foil_token, req.foil_token_id, "foil_token", required=False)
    if foil_id is None and (req.metric == "logit_diff" or (req.metric == "recovered" and req.recovered_basis == "logit_diff")):
        raise SpecError("foil_token", f"is required for metric {req.metric!r}" + (" with recovered_basis 'logit_diff'" if req.metric == "recovered" else ""))
    if foil_id is not None and foil_id == answer_id:
        raise SpecError("foil_token", "must differ from the answer token")

    positions = sorted(set(engine.resolve_positions(req.prompt, req.positions_json(), "positions")))
    subject_positions: list[int] = []
    if req.subject is not None:
        subject_positions = engine.resolve_positions(req.prompt, [req.subject.model_dump()], "subject")

    # ---- the source of patched values -----------------------------------------------------
    noise_positions = None
    clean_ids: list[int] | None = None
    if req.noise is not None:
        nz = req.noise
        if (nz.span is None) == (nz.positions is None):
            raise SpecError("noise", "give exactly one of noise.span or noise.positions")
        if req.clean_prompt is not None and req.clean_prompt != req.prompt:
            raise SpecError("clean_prompt", "must be omitted with noise corruption (the clean run is the prompt without noise)")
        sel = [{"span": nz.span, "occurrence": nz.occurrence}] if nz.span is not None else list(nz.positions)
        noise_positions = sorted(set(engine.resolve_positions(req.prompt, sel, "noise.span" if nz.span else "noise.positions")))
        if not subject_positions:
            subject_positions = list(noise_positions)
        clean_ids = list(corrupt_ids)
    elif req.clean_prompt is not None:
        clean_ids = engine.tokenize(req.clean_prompt)
        try:
            engine.validate(clean_ids, GenerationParams(max_tokens=1))
        except SpecError as exc:
            raise SpecError("clean_prompt", exc.message) from None

    run_sites = tuple(sorted({Site(l, h).index() for l in layers for h in (HOOKS if req.keep_source else hooks)}))
    if req.source_inline is not None:
        source = _inline_source(engine, req)
    elif req.source_module is not None:
        source = _module_source(engine, req, clean_ids, source_exists, run_sites, layers, hooks)
    elif req.source_run is not None and source_exists.get(req.source_run) is not None:
        stored = source_exists[req.source_run]
        missing = [str(Site(l, h)) for l in layers for h in hooks if Site(l, h).index() not in stored["sites"]]
        if missing:
            if clean_ids is None:
                raise SpecError("source_run", f"run {req.source_run!r} holds no values at {', '.join(missing[:4])}"
                                + (" …" if len(missing) > 4 else "") + "; sweep sites it captured, or give clean_prompt to re-capture")
            source = SourcePlan("run", req.source_run + f"-{uuid.uuid4().hex[:6]}", capture=True, capture_sites=run_sites)
        else:
            source = SourcePlan("run", req.source_run)
            if clean_ids is None:
                n_run = max(stored["positions"]) + 1 if stored["positions"] else 0
                if n_run != len(corrupt_ids):
                    raise SpecError("source_run", f"run {req.source_run!r} has {n_run} positions, the prompt {len(corrupt_ids)} tokens; "
                                    "give clean_prompt so the positions can be aligned")
    elif req.source_run is not None or clean_ids is not None:
        if clean_ids is None:
            raise PlanError(404, "source_run", f"no stored run {req.source_run!r} (never captured, dropped or evicted); "
                            "give clean_prompt to capture it")
        source = SourcePlan("run", req.source_run or f"sweep-{uuid.uuid4().hex[:12]}", capture=True, capture_sites=run_sites)
        _check_budget(engine, len(run_sites) * len(clean_ids), "noise" if req.noise else "clean_prompt")
    else:
        raise SpecError("clean_prompt", "a source is required: clean_prompt, source_run, source_module or noise")

    if req.metric == "recovered" and clean_ids is None and req.clean_baseline is None and source.kind != "run":
        # an ablation has no clean run to normalise by (the fork refuses this too); a stored run
        # without a clean value is answered with the raw basis grid (see SweepService._prepare)
        raise SpecError("clean_baseline", "metric 'recovered' needs the clean value: give clean_prompt or clean_baseline")

    mask = None
    if req.mask is not None:  # the fork's {"indices"} or {"inline": row of patch_vectors}, on every cell
        from app.fork.vectors import parse_patch_vectors
        from app.fork.masks import fork_mask

        table = parse_patch_vectors(req.patch_vectors, "patch_vectors", hidden=info.hidden_size)
        mask = fork_mask(req.mask, "mask", table=table, hidden=info.hidden_size)

    # ---- alignment and cells ----------------------------------------------------------------
    alignment = None
    skipped: list[dict] = []
    mapping: dict[int, int | None]
    if source.kind == "run":
        if clean_ids is not None:
            alignment = align_positions(clean_ids, corrupt_ids)
            mapping = dict(alignment.position_map)
        else:
            mapping = {p: p for p in range(len(corrupt_ids))}
        for p in positions:
            if p not in mapping:
                skipped.append({"position": p, "reason": UNALIGNED_REASON})
    else:
        mapping = {p: None for p in positions}
    cells = [SweepCell(h, l, p, mapping[p]) for h in hooks for l in layers for p in positions if p in mapping]
    if not cells:
        raise SpecError("positions", "no swept position is aligned between the clean and corrupt prompts")
    limit = 100_000
    if len(cells) * (req.noise.samples if req.noise else 1) > limit:
        raise SpecError("layers", f"the sweep has {len(cells)} cells x samples; at most {limit} per sweep")

    return SweepPlan(
        sweep_id=f"sw-{uuid.uuid4().hex[:12]}",
        request=req,
        corrupt_ids=corrupt_ids,
        clean_ids=clean_ids,
        answer_id=answer_id,
        foil_id=foil_id,
        layers=layers,
        positions=positions,
        hooks=hooks,
        alignment=alignment,
        skipped_positions=skipped,
        cells=cells,
        source=source,
        noise_positions=noise_positions,
        subject_positions=sorted(set(subject_positions)),
        mask=mask,
    )


def _layers(value: list[int] | LayerRange | None, num_layers: int) -> list[int]:
    if value is None:
        return list(range(num_layers))
    if isinstance(value, LayerRange):
        if value.stop > num_layers:
            raise SpecError("layers.stop", f"{value.stop} is beyond the model's {num_layers} layers (stop is exclusive)")
        layers = list(range(value.start, value.stop, value.step))
    else:
        layers = list(value)
        for k, layer in enumerate(layers):
            if not 0 <= layer < num_layers:
                raise SpecError(f"layers[{k}]", f"layer {layer} is out of range: the model has layers 0..{num_layers - 1}")
    if not layers:
        raise SpecError("layers", "selects no layer")
    return sorted(set(layers))


def _token_id(engine: Engine, text: str | None, token_id: int | None, field_name: str, required: bool) -> int | None:
    id_field = f"{field_name}_id"
    vocab = engine.info.vocab_size
    if token_id is not None:
        if token_id >= vocab:
            raise SpecError(id_field, f"token id {token_id} is outside the vocabulary [0, {vocab})")
        if text is not None and _single_token(engine, text) not in (token_id, None):
            raise SpecError(field_name, f"{text!r} does not tokenize to {id_field} {token_id}")
        return token_id
    if text is None:
        if required:
            raise SpecError(field_name, f"required: give {field_name} (one token of text) or {id_field}")
        return None
    tid = _single_token(engine, text)
    if tid is None:
        ids = engine.tokenize(text, add_special_tokens=False)
        raise SpecError(field_name, f"{text!r} is {len(ids)} tokens ({engine.token_strings(ids)}); "
                        f"it must be exactly one token — pass {id_field} instead")
    return tid


def _single_token(engine: Engine, text: str) -> int | None:
    ids = engine.tokenize(text, add_special_tokens=False)
    if len(ids) != 1 and not text.startswith(" "):
        ids = engine.tokenize(" " + text, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None


def _inline_source(engine: Engine, req: PatchSweepRequest) -> SourcePlan:
    """The fork's `source_inline`: row `source_inline` of the packed `patch_vectors` table,
    patched into every cell."""
    from app.fork.vectors import parse_patch_vectors

    if req.patch_vectors is None:
        raise SpecError("patch_vectors", "is required with source_inline (the table it indexes)")
    table = parse_patch_vectors(req.patch_vectors, "patch_vectors", hidden=engine.info.hidden_size)
    row = req.source_inline
    if not 0 <= row < table.shape[0]:
        raise SpecError("source_inline", f"row {row} is outside patch_vectors ({table.shape[0]} rows)")
    return SourcePlan("inline", name=f"patch_vectors[{row}]", vector=np.asarray(table[row], dtype=np.float32))


def _module_source(engine: Engine, req: PatchSweepRequest, clean_ids: list[int] | None,
                   source_exists: dict[str, dict | None], run_sites: tuple[int, ...],
                   layers: list[int], hooks: list[str]) -> SourcePlan:
    name = req.source_module
    if name in ("zeros", "zero"):
        return SourcePlan("zeros", name="zeros")
    if name == "mean":
        if req.source_run is not None and source_exists.get(req.source_run) is not None:
            return SourcePlan("mean", req.source_run, name="mean")
        if clean_ids is None:
            raise SpecError("source_module", "'mean' needs the run to average: give clean_prompt or a stored source_run")
        _check_budget(engine, len(run_sites) * len(clean_ids), "clean_prompt")
        return SourcePlan("mean", req.source_run or f"sweep-{uuid.uuid4().hex[:12]}", name="mean", capture=True, capture_sites=run_sites)
    from app.fork import steering_modules

    if name in steering_modules.modules(engine):
        # the fork's semantics: each cell is patched with the module's (both-phase) vector at the
        # cell's own (hook, layer). A cell whose site the module lacks would run unpatched in the
        # fork (then be voided); here the sweep is refused up front, naming the sites.
        site_vectors, missing = {}, []
        for h in hooks:
            for layer in layers:
                vec = engine.named_vector(steering_modules.vector_name(name, "both", Site(layer, h)))
                if vec is None:
                    missing.append(str(Site(layer, h)))
                else:
                    site_vectors[(layer, h)] = vec
        if missing:
            raise SpecError("source_module", f"steering module {name!r} has no vector at {', '.join(missing[:6])}"
                                             + (" …" if len(missing) > 6 else "") + "; sweep only the sites it covers")
        return SourcePlan("module", name=name, site_vectors=site_vectors)
    vector = engine.named_vector(name)  # a float32 copy, or None
    if vector is None:
        raise PlanError(404, "source_module", f"no steering module or registered vector named {name!r} "
                                              "(built in: 'zeros', 'mean')")
    return SourcePlan("vector", name=name, vector=vector)


def _check_budget(engine: Engine, n_values: int, field_name: str) -> None:
    info = engine.info
    itemsize = 4 if "32" in info.dtype else 2
    need = n_values * 2 * info.hidden_size * itemsize  # the (hidden, residual) pair per value
    budget = engine.config.source_store_bytes
    if need > budget:
        raise PlanError(507, field_name, f"the clean run needs {need} bytes of source store ({n_values} site x position values); "
                        f"the store budget is {budget} bytes — sweep fewer layers/hooks or raise source_store_bytes")


__all__ = ["PlanError", "SweepCell", "SourcePlan", "SweepPlan", "build_plan"]

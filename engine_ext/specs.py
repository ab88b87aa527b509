"""Plain-data intervention specs: steer / capture / patch / noise, and position selectors.

These are what a client writes (Python, JSON over HTTP). `Engine` validates them against the
model and the prompt and compiles them into the wire program (`program.compile_program`) that
travels to the workers in `SamplingParams.extra_args`. No code, only data: every spec has one
canonical JSON form (`to_json`) and one hash (`spec_hash`).

Sites (`L3.post_attn`), hooks and the selector text syntax are defined in `engine_ext.sites`.

Positions
---------
`"last_prompt"`, `"all_prompt"`, `"all_generated"`, `"all"`, a list of token indices (negative
= from the end of the prompt: -1 is the last prompt token), a span `{"span": text,
"occurrence": n}` (the tokens overlapping the n-th occurrence of `text` in the prompt,
0-based), or a list mixing indices and spans. Position 0 is the BOS token when the tokenizer
adds one.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import re
from dataclasses import dataclass
from typing import Any, Literal, Union

import numpy as np

from engine_ext.errors import SpecError
from engine_ext.sites import NAMED_POSITIONS, PHASES, Site, Span

PositionItem = Union[int, Span]
Positions = Union[str, tuple[PositionItem, ...]]


def positions_from_json(value: Any, field_name: str = "positions") -> Positions:
    """Parse the JSON form of a position selector (see module docstring)."""
    if isinstance(value, str):
        if value not in NAMED_POSITIONS:
            raise SpecError(field_name, f"unknown position selector {value!r}; expected one of {', '.join(NAMED_POSITIONS)}, a list of indices or a span")
        return value
    items = value if isinstance(value, (list, tuple)) else [value]
    if not items:
        raise SpecError(field_name, "must not be empty")
    out: list[PositionItem] = []
    for k, item in enumerate(items):
        if isinstance(item, bool):
            raise SpecError(f"{field_name}[{k}]", "must be an integer index or a span, not a boolean")
        if isinstance(item, int):
            out.append(item)
        elif isinstance(item, Span):
            out.append(item)
        elif isinstance(item, dict) and "span" in item:
            extra = set(item) - {"span", "occurrence"}
            if extra:
                raise SpecError(f"{field_name}[{k}].{sorted(extra)[0]}", "unknown field in a span")
            text, occ = item["span"], item.get("occurrence", 0)
            if not isinstance(text, str) or not text:
                raise SpecError(f"{field_name}[{k}].span", "must be a non-empty string")
            if not isinstance(occ, int) or isinstance(occ, bool) or occ < 0:
                raise SpecError(f"{field_name}[{k}].occurrence", f"must be an integer >= 0, got {occ!r}")
            out.append(Span(text, occ))
        else:
            raise SpecError(f"{field_name}[{k}]", f"must be an integer index or {{'span': text}}, got {item!r}")
    return tuple(out)


def positions_to_json(value: Positions) -> Any:
    if isinstance(value, str):
        return value
    return [p if isinstance(p, int) else {"span": p.text, "occurrence": p.occurrence} for p in value]


# ---- vectors -------------------------------------------------------------------------------
def as_vector(value: Any, field_name: str) -> np.ndarray:
    """A finite 1-D float32 vector from a list / ndarray / tensor; SpecError otherwise."""
    try:
        if hasattr(value, "detach"):
            value = value.detach().float().cpu().numpy()
        arr = np.asarray(value, dtype=np.float32)
    except (TypeError, ValueError) as exc:
        raise SpecError(field_name, f"is not a numeric vector ({exc})") from None
    if arr.ndim != 1 or arr.size == 0:
        raise SpecError(field_name, f"must be a non-empty 1-D vector, got shape {list(arr.shape)}")
    if not np.all(np.isfinite(arr)):
        raise SpecError(field_name, "contains NaN or infinite values")
    return np.ascontiguousarray(arr)


def encode_vector(arr: np.ndarray) -> str:
    """Canonical wire form of a vector: base64 of float32 little-endian bytes."""
    return base64.b64encode(np.ascontiguousarray(arr, dtype="<f4").tobytes()).decode("ascii")


def decode_vector(text: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(text), dtype="<f4").copy()


# ---- dimension masks -----------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class Mask:
    """Which dimensions of a site an intervention touches: `indices` (the reference fork's
    `{"indices": [...]}`: those dimensions fully, the others not at all) or `weights` (one value
    in [0, 1] per dimension: graded). A patch becomes `(1 - alpha * m) * h + alpha * m * t` per
    dimension, a steer adds `scale * m * v`."""

    indices: tuple[int, ...] | None = None
    weights: np.ndarray | None = None

    def to_json(self) -> dict:
        if self.indices is not None:
            return {"indices": list(self.indices)}
        return {"weights": encode_vector(self.weights)}

    def values(self, hidden: int, field_name: str = "mask") -> np.ndarray:
        """The float32 weight of every dimension; SpecError naming the field if it does not fit `hidden`."""
        if self.indices is not None:
            bad = [k for k, i in enumerate(self.indices) if i >= hidden]
            if bad:
                raise SpecError(f"{field_name}.indices[{bad[0]}]", f"dimension {self.indices[bad[0]]} is out of range: the hidden size is {hidden}")
            m = np.zeros(hidden, np.float32)
            m[list(self.indices)] = 1.0
            return m
        if self.weights.shape[0] != hidden:
            raise SpecError(f"{field_name}.weights", f"has {self.weights.shape[0]} values, the model's hidden size is {hidden}")
        return self.weights


MAX_MASK_INDICES = 1 << 20


def mask_from_json(value: Any, field_name: str = "mask") -> Mask | None:
    """A `Mask` from its JSON forms: `{"indices": [int, ...]}` (the fork's), a plain list of
    dimension indices, a list of booleans (one per dimension: true = masked in),
    `{"weights": [floats in [0, 1]]}` (one per dimension, or its base64 float32 form) — or None."""
    if value is None or isinstance(value, Mask):
        return value
    if isinstance(value, dict):
        extra = set(value) - {"indices", "weights"}
        if extra:
            raise SpecError(f"{field_name}.{sorted(extra)[0]}", "unknown mask field; give 'indices' or 'weights'")
        if len(value) != 1:
            raise SpecError(field_name, "give exactly one of 'indices' and 'weights'")
        if "indices" in value:
            return _mask_indices(value["indices"], f"{field_name}.indices")
        w = value["weights"]
        arr = decode_vector(w) if isinstance(w, str) else as_vector(w, f"{field_name}.weights")
        if arr.size == 0 or not np.all(np.isfinite(arr)) or arr.min() < 0 or arr.max() > 1:
            raise SpecError(f"{field_name}.weights", "must be finite values in [0, 1], one per dimension")
        return Mask(weights=np.ascontiguousarray(arr, np.float32))
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, bool) for v in value):
        idx = tuple(i for i, v in enumerate(value) if v)
        if not idx:
            raise SpecError(field_name, "masks no dimension (every entry is false)")
        return Mask(weights=np.asarray(value, np.float32))
    if isinstance(value, (list, tuple)):
        return _mask_indices(value, field_name)
    raise SpecError(field_name, "must be {'indices': [dims]}, a list of dimension indices, a list of booleans "
                                "(one per dimension) or {'weights': [values in [0, 1]]}")


def _mask_indices(value: Any, field_name: str) -> Mask:
    if not isinstance(value, (list, tuple)) or not value:
        raise SpecError(field_name, "must be a non-empty list of dimension indices")
    if len(value) > MAX_MASK_INDICES:
        raise SpecError(field_name, f"at most {MAX_MASK_INDICES} indices")
    for k, i in enumerate(value):
        if not isinstance(i, (int, np.integer)) or isinstance(i, bool) or i < 0:
            raise SpecError(f"{field_name}[{k}]", f"must be a dimension index >= 0, got {i!r}")
    return Mask(indices=tuple(sorted({int(i) for i in value})))


# ---- interventions ---------------------------------------------------------------------------
def _sites(value: Any, field_name: str) -> tuple[Site, ...]:
    items = value if isinstance(value, (list, tuple)) else [value]
    if not items:
        raise SpecError(field_name, "must name at least one site")
    out = []
    for k, s in enumerate(items):
        if isinstance(s, Site):
            out.append(s)
        elif isinstance(s, str):
            try:
                out.append(Site.parse(s))
            except SpecError as exc:
                raise SpecError(f"{field_name}[{k}]", exc.message) from None
        elif isinstance(s, (list, tuple)) and len(s) == 2:
            out.append(Site(int(s[0]), str(s[1])))
        elif isinstance(s, dict) and set(s) == {"layer", "hook"}:
            out.append(Site(s["layer"], s["hook"]))
        else:
            raise SpecError(f"{field_name}[{k}]", f"not a site: {s!r} (use 'L3.post_attn' or {{'layer': 3, 'hook': 'post_attn'}})")
    return tuple(dict.fromkeys(out))


@dataclass(frozen=True, eq=False)
class Steer:
    """Add `scale * vector` to the stream at `sites` and `positions` during `phase` (only on the
    dimensions of `mask`, when given: `scale * m * vector`).

    Exactly one of `vector` (inline) and `name` (a registered named vector) is given."""

    sites: tuple[Site, ...]
    vector: np.ndarray | None = None
    name: str | None = None
    scale: float = 1.0
    positions: Positions = "all"
    phase: Literal["both", "prefill", "decode"] = "both"
    mask: Mask | None = None

    @classmethod
    def make(cls, sites: Any, vector: Any = None, *, name: str | None = None, scale: float = 1.0,
             positions: Any = "all", phase: str = "both", mask: Any = None, field_name: str = "steer") -> "Steer":
        if (vector is None) == (name is None):
            raise SpecError(f"{field_name}.vector", "give exactly one of an inline 'vector' and a registered 'name'")
        if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not math.isfinite(scale):
            raise SpecError(f"{field_name}.scale", f"must be a finite number, got {scale!r}")
        if phase not in PHASES:
            raise SpecError(f"{field_name}.phase", f"must be one of {', '.join(PHASES)}, got {phase!r}")
        vec = as_vector(vector, f"{field_name}.vector") if vector is not None else None
        return cls(_sites(sites, f"{field_name}.sites"), vec, name, float(scale),
                   positions_from_json(positions, f"{field_name}.positions"), phase,  # type: ignore[arg-type]
                   mask_from_json(mask, f"{field_name}.mask"))

    def to_json(self) -> dict:
        out = {"sites": [str(s) for s in self.sites],
               "vector": encode_vector(self.vector) if self.vector is not None else None,
               "name": self.name, "scale": self.scale,
               "positions": positions_to_json(self.positions), "phase": self.phase}
        if self.mask is not None:
            out["mask"] = self.mask.to_json()
        return out


def _bound(value: Any, field_name: str) -> float | None:
    if value is None:
        return None
    if not isinstance(value, (int, float, np.floating, np.integer)) or isinstance(value, bool) or not math.isfinite(value):
        raise SpecError(field_name, f"must be a finite number (or null: unbounded), got {value!r}")
    return float(value)


@dataclass(frozen=True, eq=False)
class Clamp:
    """A directional clamp (the reference fork's `steering_clamps`): at `sites` and `positions`
    during `phase`, constrain the stream's projection onto the unit direction `v = vector / |vector|`
    to `[min, max]` (None: unbounded on that side)::

        p  = s . v                                  (float32)
        s' = s + strength * (clip(p, min, max) - p) * v

    A value already inside the bounds is left untouched; `min == max` pins the projection
    (`value` sets both), `min == max == 0` is directional ablation, `strength` in [0, 1] applies
    part of the correction. Clamps act after every patch and add at the same site and position;
    several clamps there are corrected together from the same `s` (the fork's rule)."""

    sites: tuple[Site, ...]
    vector: np.ndarray
    min: float | None = None
    max: float | None = None
    strength: float = 1.0
    positions: Positions = "all"
    phase: Literal["both", "prefill", "decode"] = "both"

    @classmethod
    def make(cls, sites: Any, vector: Any, *, min: Any = None, max: Any = None, value: Any = None,
             strength: Any = 1.0, positions: Any = "all", phase: str = "both", field_name: str = "clamp") -> "Clamp":
        vec = as_vector(vector, f"{field_name}.vector")
        if not float(np.linalg.norm(vec.astype(np.float64))) > 0.0:
            raise SpecError(f"{field_name}.vector", "must be non-zero (a zero vector has no direction)")
        if value is not None:
            if min is not None or max is not None:
                raise SpecError(f"{field_name}.value", "give either 'value' or 'min'/'max', not both")
            lo = hi = _bound(value, f"{field_name}.value")
        else:
            lo, hi = _bound(min, f"{field_name}.min"), _bound(max, f"{field_name}.max")
            if lo is None and hi is None:
                raise SpecError(f"{field_name}.min", "set at least one of 'value', 'min' and 'max'")
            if lo is not None and hi is not None and lo > hi:
                raise SpecError(f"{field_name}.min", f"min ({lo}) must be <= max ({hi})")
        if (not isinstance(strength, (int, float, np.floating)) or isinstance(strength, bool) or not math.isfinite(strength)
                or not 0.0 <= strength <= 1.0):
            raise SpecError(f"{field_name}.strength", f"must be a number in [0, 1], got {strength!r}")
        if phase not in PHASES:
            raise SpecError(f"{field_name}.phase", f"must be one of {', '.join(PHASES)}, got {phase!r}")
        return cls(_sites(sites, f"{field_name}.sites"), vec, lo, hi, float(strength),
                   positions_from_json(positions, f"{field_name}.positions"), phase)  # type: ignore[arg-type]

    def unit(self) -> np.ndarray:
        """The float32 unit direction (normalised in float64, as the fork does)."""
        v = self.vector.astype(np.float64)
        return (v / np.linalg.norm(v)).astype(np.float32)

    def to_json(self) -> dict:
        return {"sites": [str(s) for s in self.sites], "vector": encode_vector(self.vector), "min": self.min,
                "max": self.max, "strength": self.strength, "positions": positions_to_json(self.positions),
                "phase": self.phase}


#: the one character set of user-chosen names (stored source runs `keep_as`, named vectors):
#: letters, digits, '_', '-', '.', ':' — no '/' (a name must read back as one URL path segment)
SAFE_NAME = re.compile(r"[\w.\-:]{1,128}")
SAFE_NAME_RULE = "must be 1-128 characters of letters, digits, '_', '-', '.', ':'"


def check_safe_name(name: Any, field_name: str, allow_none: bool = False) -> None:
    """Raise `SpecError(field_name)` unless `name` is a string of the safe name set."""
    if name is None and allow_none:
        return
    if not isinstance(name, str) or not SAFE_NAME.fullmatch(name):
        raise SpecError(field_name, SAFE_NAME_RULE)


@dataclass(frozen=True)
class Capture:
    """Record the stream at `sites` × `positions` (after any intervention at that site).

    `keep_as` stores the whole capture on the workers as a named source run for patching;
    `lease` also leases it there as it is stored (one `Engine.lease_source`, with no moment in
    which another request's capture could evict it; the caller releases or drops it);
    `return_values` delivers the arrays to the client."""

    sites: tuple[Site, ...]
    positions: Positions = "last_prompt"
    keep_as: str | None = None
    return_values: bool = True
    lease: bool = False

    @classmethod
    def make(cls, sites: Any, positions: Any = "last_prompt", *, keep_as: str | None = None,
             return_values: bool = True, lease: bool = False, field_name: str = "capture") -> "Capture":
        check_safe_name(keep_as, f"{field_name}.keep_as", allow_none=True)
        if lease and keep_as is None:
            raise SpecError(f"{field_name}.lease", "leases the stored run: it needs keep_as")
        return cls(_sites(sites, f"{field_name}.sites"), positions_from_json(positions, f"{field_name}.positions"),
                   keep_as, bool(return_values), bool(lease))

    def to_json(self) -> dict:
        out = {"sites": [str(s) for s in self.sites], "positions": positions_to_json(self.positions),
               "keep_as": self.keep_as, "return_values": self.return_values}
        if self.lease:  # absent when false: the canonical form of every capture without it is unchanged
            out["lease"] = True
        return out


@dataclass(frozen=True)
class RunSource:
    """Values from a stored source run: `positions` of the run (default: the destination
    positions themselves), one per destination position."""

    run_id: str
    positions: tuple[int, ...] | None = None


@dataclass(frozen=True, eq=False)
class InlineSource:
    """Explicit vectors: one per destination position, or one for all of them."""

    vectors: tuple[np.ndarray, ...]


@dataclass(frozen=True)
class ZeroSource:
    """Zero-ablation: replace with the zero vector."""


@dataclass(frozen=True)
class MeanSource:
    """Mean-ablation: replace with the mean of a stored run's values at the same site (over all
    positions the run captured there)."""

    run_id: str


Source = Union[RunSource, InlineSource, ZeroSource, MeanSource]


@dataclass(frozen=True, eq=False)
class Patch:
    """At `site` and destination `positions`: replace (alpha = 1) or lerp
    `(1 - alpha) * h + alpha * t` with values `t` from `source` — with a `mask`, per dimension
    `(1 - alpha * m) * h + alpha * m * t` (dimensions outside the mask keep their value exactly)."""

    site: Site
    positions: Positions
    source: Source
    alpha: float = 1.0
    mask: Mask | None = None

    @classmethod
    def make(cls, site: Any, positions: Any, source: Any, *, alpha: float = 1.0, mask: Any = None,
             field_name: str = "patch") -> "Patch":
        sites = _sites(site, f"{field_name}.site")
        if len(sites) != 1:
            raise SpecError(f"{field_name}.site", "a patch names exactly one site")
        if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
            raise SpecError(f"{field_name}.alpha", f"must be a finite number, got {alpha!r}")
        return cls(sites[0], positions_from_json(positions, f"{field_name}.positions"),
                   _source(source, f"{field_name}.source"), float(alpha), mask_from_json(mask, f"{field_name}.mask"))

    def to_json(self) -> dict:
        src = self.source
        if isinstance(src, RunSource):
            sj: dict = {"run": src.run_id, "positions": list(src.positions) if src.positions is not None else None}
        elif isinstance(src, InlineSource):
            sj = {"vectors": [encode_vector(v) for v in src.vectors]}
        elif isinstance(src, MeanSource):
            sj = {"mean_of": src.run_id}
        else:
            sj = {"zero": True}
        out = {"site": str(self.site), "positions": positions_to_json(self.positions), "source": sj, "alpha": self.alpha}
        if self.mask is not None:
            out["mask"] = self.mask.to_json()
        return out


def _source(value: Any, field_name: str) -> Source:
    if isinstance(value, (RunSource, InlineSource, ZeroSource, MeanSource)):
        return value
    if value == "zeros" or value == "zero":
        return ZeroSource()
    if isinstance(value, dict):
        if "run" in value:
            run, pos = value["run"], value.get("positions")
            if not isinstance(run, str) or not run:
                raise SpecError(f"{field_name}.run", "must be a run id")
            if pos is not None:
                if not isinstance(pos, (list, tuple)) or not all(isinstance(p, int) and not isinstance(p, bool) for p in pos):
                    raise SpecError(f"{field_name}.positions", "must be a list of integer positions of the source run")
                pos = tuple(pos)
            return RunSource(run, pos)
        if "vectors" in value or "vector" in value:
            raw = value.get("vectors", [value.get("vector")])
            return InlineSource(tuple(as_vector(v, f"{field_name}.vectors[{k}]") for k, v in enumerate(raw)))
        if "mean_of" in value:
            return MeanSource(str(value["mean_of"]))
        if value.get("zero") is True:
            return ZeroSource()
    raise SpecError(field_name, "must be 'zeros', {'run': id, 'positions': [...]}, {'vectors': [...]} or {'mean_of': run_id}")


@dataclass(frozen=True, eq=False)
class Noise:
    """ROME-style corruption: add Gaussian noise of `scale` × (std of the embedding matrix) to the
    input embeddings at `positions` (seeded; site L0.pre_attn)."""

    positions: Positions
    scale: float = 3.0
    seed: int = 0

    @classmethod
    def make(cls, positions: Any, *, scale: float = 3.0, seed: int = 0, field_name: str = "noise") -> "Noise":
        if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not math.isfinite(scale) or scale < 0:
            raise SpecError(f"{field_name}.scale", f"must be a finite number >= 0, got {scale!r}")
        if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
            raise SpecError(f"{field_name}.seed", f"must be an integer >= 0, got {seed!r}")
        return cls(positions_from_json(positions, f"{field_name}.positions"), float(scale), seed)

    def to_json(self) -> dict:
        return {"positions": positions_to_json(self.positions), "scale": self.scale, "seed": self.seed}


@dataclass(frozen=True, eq=False)
class Interventions:
    """Everything one request asks of the engine besides generation."""

    steer: tuple[Steer, ...] = ()
    patch: tuple[Patch, ...] = ()
    capture: Capture | None = None
    noise: Noise | None = None
    #: score these token ids exactly at every generated step (vLLM logprob_token_ids)
    score_token_ids: tuple[int, ...] = ()
    #: directional clamps (after every patch and add at their site)
    clamp: tuple[Clamp, ...] = ()

    def is_empty(self) -> bool:
        return not (self.steer or self.patch or self.capture or self.noise or self.score_token_ids or self.clamp)

    def modifies_stream(self) -> bool:
        return bool(self.steer or self.patch or self.noise or self.clamp)

    def to_json(self) -> dict:
        out = {
            "steer": [s.to_json() for s in self.steer],
            "patch": [p.to_json() for p in self.patch],
            "capture": self.capture.to_json() if self.capture else None,
            "noise": self.noise.to_json() if self.noise else None,
            "score_token_ids": list(self.score_token_ids),
        }
        if self.clamp:  # absent when empty: the JSON (and hash) of clamp-free specs is unchanged
            out["clamp"] = [c.to_json() for c in self.clamp]
        return out


def canonical_json(data: Any) -> str:
    """The one canonical serialization: sorted keys, no whitespace, no NaN."""
    return json.dumps(data, sort_keys=True, separators=(",", ":"), allow_nan=False)


def spec_hash(data: Any) -> str:
    """sha256 (hex, 32 chars) of the canonical JSON of `data`."""
    return hashlib.sha256(canonical_json(data).encode()).hexdigest()[:32]

"""Plain-data specs of dynamic steering: probes and policies (no client code is ever executed).

A **probe** reads the residual stream at one site (`engine_ext.sites`: `L3.post_block`) and turns
the value `s` there (fp32, `x + r` after the interventions at that site) into `k` scores
`W @ s + b` (`W`: `[k, hidden]`, `b`: `[k]`). Kinds: `direction` (one unit-free direction,
`b = 0`), `linear` (one classifier: weights and bias) and `bank` (`k` classifiers).

A **policy** turns one of a probe's scores (`component`) into a steering action, decided on the
worker right after the forward at position `p` and applied at position `p + 1` (the next step):

* `threshold` — engage when the score is `>= on`; once engaged, release when it is `< off`
  (`off <= on`: hysteresis) and steering has been applied for at least `min_hold` tokens.
  While engaged the action adds `scale * vector` at `sites`.
* `proportional` — hold the probe's score at `target`: after each forward the scale becomes
  `clip(scale + gain * (target - score), min_scale, max_scale)` (starting from
  `initial_scale`); the action adds `scale * vector` at `sites` (nothing when the scale is 0).
* `latch` (threshold only) — `none`; `request`: once engaged, stays engaged for the rest of the
  request; `conversation`: as `request`, and later requests carrying the same
  `conversation_id` and the same policy start engaged (from their first generated position).

Dynamic actions apply to generated positions only (the decode phase): the first decision is made
after the prompt's last position and applies to the first generated token fed back.

Probes and policies have one canonical JSON form (`to_json`) that travels to the workers (a
request's: `DynamicRequest.wire`); `Probe.make`, `Policy.make` / `Policy.from_json` and
`DynamicRequest.make` validate and raise `SpecError` naming the field.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine_ext.errors import SpecError
from engine_ext.sites import Site
from engine_ext.specs import as_vector, decode_vector, encode_vector, spec_hash

#: SamplingParams.extra_args key of a request's dynamic-steering data (canonical JSON text)
DYNAMIC_ARGS_KEY = "causalboard_dynamic"
PROBE_KINDS = ("direction", "linear", "bank")
POLICY_MODES = ("threshold", "proportional")
LATCHES = ("none", "request", "conversation")
#: at most this many scores per probe (a "small bank") and policies per request
MAX_BANK = 16
MAX_POLICIES = 8
_NAME_RE = re.compile(r"^[A-Za-z0-9_.:\-]{1,128}$")


def check_name(name: Any, field_name: str = "name") -> str:
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise SpecError(field_name, "must be 1-128 characters of letters, digits, '_', '-', '.', ':'")
    return name


def _finite(value: Any, field_name: str) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise SpecError(field_name, f"must be a finite number, got {value!r}")
    return float(value)


def _site(value: Any, field_name: str) -> Site:
    if isinstance(value, Site):
        return value
    if isinstance(value, str):
        try:
            return Site.parse(value)
        except SpecError as exc:
            raise SpecError(field_name, exc.message) from None
    if isinstance(value, dict) and set(value) == {"layer", "hook"}:
        try:
            return Site(value["layer"], value["hook"])
        except SpecError as exc:
            raise SpecError(field_name, exc.message) from None
    raise SpecError(field_name, f"not a site: {value!r} (use 'L3.post_block')")


def check_site(site: Site, num_layers: int, field_name: str) -> None:
    if site.layer >= num_layers:
        raise SpecError(field_name, f"layer {site.layer} is out of range: the model has layers 0..{num_layers - 1}")


# ---- probes ---------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class Probe:
    """`k` linear scores `weights @ s + bias` of the stream `s` at `site`."""

    name: str
    site: Site
    kind: str
    weights: np.ndarray  # [k, hidden] float32
    bias: np.ndarray     # [k] float32
    labels: tuple[str, ...] = ()
    description: str = ""

    @property
    def size(self) -> int:
        return int(self.weights.shape[0])

    @property
    def hidden_size(self) -> int:
        return int(self.weights.shape[1])

    @classmethod
    def make(cls, name: Any, site: Any, *, kind: str = "direction", direction: Any = None, weights: Any = None,
             bias: Any = None, labels: Any = (), description: str = "", field_name: str = "") -> "Probe":
        """Validate a probe. `direction` (kind `direction`) or `weights` ([H] for `linear`,
        [k, H] for `bank`) with `bias` (a number for `linear`, k numbers for `bank`)."""
        f = (field_name + ".") if field_name else ""
        name = check_name(name, f + "name")
        site = _site(site, f + "site")
        if kind not in PROBE_KINDS:
            raise SpecError(f + "kind", f"must be one of {', '.join(PROBE_KINDS)}, got {kind!r}")
        if kind == "direction":
            if direction is None or weights is not None:
                raise SpecError(f + "direction", "a direction probe takes 'direction' (and no 'weights')")
            if bias not in (None, 0, 0.0):
                raise SpecError(f + "bias", "a direction probe has no bias (use kind 'linear')")
            w = as_vector(direction, f + "direction")[None, :]
            if not np.any(w):
                raise SpecError(f + "direction", "must not be the zero vector")
            b = np.zeros(1, np.float32)
        elif kind == "linear":
            if weights is None or direction is not None:
                raise SpecError(f + "weights", "a linear probe takes 'weights' (one vector) and 'bias'")
            w = as_vector(weights, f + "weights")[None, :]
            b = np.asarray([_finite(0.0 if bias is None else bias, f + "bias")], np.float32)
        else:
            if weights is None or direction is not None:
                raise SpecError(f + "weights", "a bank takes 'weights' (k vectors) and 'bias' (k numbers)")
            if not isinstance(weights, (list, tuple, np.ndarray)) or len(weights) == 0:
                raise SpecError(f + "weights", "must be a non-empty list of vectors")
            if len(weights) > MAX_BANK:
                raise SpecError(f + "weights", f"a bank holds at most {MAX_BANK} classifiers, got {len(weights)}")
            rows = [as_vector(v, f"{f}weights[{j}]") for j, v in enumerate(weights)]
            if len({r.shape[0] for r in rows}) != 1:
                raise SpecError(f + "weights", f"rows have different dimensions {sorted({r.shape[0] for r in rows})}")
            w = np.stack(rows)
            raw = [0.0] * len(rows) if bias is None else bias
            if not isinstance(raw, (list, tuple, np.ndarray)) or len(raw) != len(rows):
                raise SpecError(f + "bias", f"must be a list of {len(rows)} numbers (one per classifier)")
            b = np.asarray([_finite(v, f"{f}bias[{j}]") for j, v in enumerate(raw)], np.float32)
        labels = tuple(labels or ())
        if labels and (len(labels) != w.shape[0] or not all(isinstance(x, str) for x in labels)):
            raise SpecError(f + "labels", f"give one label string per score ({w.shape[0]})")
        if not isinstance(description, str) or len(description) > 1000:
            raise SpecError(f + "description", "must be a string of at most 1000 characters")
        return cls(name, site, kind, np.ascontiguousarray(w, np.float32), b, labels, description)

    def check(self, num_layers: int, hidden_size: int, field_name: str = "") -> None:
        f = (field_name + ".") if field_name else ""
        check_site(self.site, num_layers, f + "site")
        if self.hidden_size != hidden_size:
            what = "direction" if self.kind == "direction" else "weights"
            raise SpecError(f + what, f"has dimension {self.hidden_size}, the model's hidden size is {hidden_size}")

    def scores(self, value: np.ndarray) -> np.ndarray:
        """The probe's scores of one stream value (host reference of the worker's computation)."""
        return (self.weights.astype(np.float32) @ np.asarray(value, np.float32) + self.bias).astype(np.float32)

    def to_json(self) -> dict:
        return {"name": self.name, "site": str(self.site), "kind": self.kind,
                "weights": [encode_vector(r) for r in self.weights], "bias": [float(v) for v in self.bias],
                "labels": list(self.labels), "description": self.description}

    @classmethod
    def from_wire(cls, data: dict) -> "Probe":
        w = np.stack([decode_vector(r) for r in data["weights"]])
        return cls(data["name"], Site.parse(data["site"]), data["kind"], w, np.asarray(data["bias"], np.float32),
                   tuple(data.get("labels") or ()), data.get("description", ""))

    def summary(self) -> dict:
        """What a listing shows (no weights)."""
        return {"name": self.name, "site": str(self.site), "kind": self.kind, "size": self.size,
                "hidden_size": self.hidden_size, "labels": list(self.labels), "description": self.description,
                "digest": spec_hash(self.to_json())[:16]}


# ---- policies --------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class Policy:
    """A plain-data policy (see the module docstring). Exactly one of `vector` / `vector_name`."""

    probe: str
    mode: str
    sites: tuple[Site, ...]
    vector: np.ndarray | None = None
    vector_name: str | None = None
    component: int = 0
    # threshold
    on: float = 0.0
    off: float | None = None
    min_hold: int = 0
    scale: float = 1.0
    latch: str = "none"
    # proportional
    target: float = 0.0
    gain: float = 0.0
    min_scale: float = 0.0
    max_scale: float = 0.0
    initial_scale: float = 0.0

    @property
    def release_at(self) -> float:
        return self.on if self.off is None else self.off

    @classmethod
    def make(cls, *, probe: Any, mode: str = "threshold", sites: Any = None, vector: Any = None,
             vector_name: str | None = None, component: int = 0, on: Any = None, off: Any = None,
             min_hold: Any = 0, scale: Any = 1.0, latch: str = "none", target: Any = None, gain: Any = None,
             min_scale: Any = None, max_scale: Any = None, initial_scale: Any = 0.0,
             field_name: str = "policy") -> "Policy":
        f = field_name + "."
        probe = check_name(probe, f + "probe")
        if mode not in POLICY_MODES:
            raise SpecError(f + "mode", f"must be one of {', '.join(POLICY_MODES)}, got {mode!r}")
        if sites is None:
            raise SpecError(f + "sites", "name the site(s) the policy steers, e.g. ['L2.post_attn']")
        items = sites if isinstance(sites, (list, tuple)) else [sites]
        if not items:
            raise SpecError(f + "sites", "must name at least one site")
        site_t = tuple(dict.fromkeys(_site(s, f"{f}sites[{j}]") for j, s in enumerate(items)))
        if (vector is None) == (vector_name is None):
            raise SpecError(f + "vector", "give exactly one of an inline 'vector' and a registered 'vector_name'")
        vec = as_vector(vector, f + "vector") if vector is not None else None
        if vector_name is not None:
            check_name(vector_name, f + "vector_name")
        if not isinstance(component, int) or isinstance(component, bool) or not 0 <= component < MAX_BANK:
            raise SpecError(f + "component", f"must be an integer in [0, {MAX_BANK}), got {component!r}")
        if latch not in LATCHES:
            raise SpecError(f + "latch", f"must be one of {', '.join(LATCHES)}, got {latch!r}")
        kw: dict[str, Any] = {}
        if mode == "threshold":
            if on is None:
                raise SpecError(f + "on", "a threshold policy needs 'on' (engage when the score is >= on)")
            on_v = _finite(on, f + "on")
            off_v = on_v if off is None else _finite(off, f + "off")
            if off_v > on_v:
                raise SpecError(f + "off", f"must be <= on ({on_v}) (hysteresis releases below 'off'), got {off_v}; "
                                           "the thresholds are inverted")
            if not isinstance(min_hold, int) or isinstance(min_hold, bool) or not 0 <= min_hold <= 1_000_000:
                raise SpecError(f + "min_hold", f"must be an integer >= 0 (tokens), got {min_hold!r}")
            kw.update(on=on_v, off=off_v, min_hold=min_hold, scale=_finite(scale, f + "scale"))
            for name, value in (("target", target), ("gain", gain), ("min_scale", min_scale), ("max_scale", max_scale)):
                if value is not None:
                    raise SpecError(f + name, "belongs to a proportional policy (mode 'proportional')")
        else:
            if target is None or gain is None:
                raise SpecError(f + ("target" if target is None else "gain"), "a proportional policy needs 'target' and 'gain'")
            if latch != "none":
                raise SpecError(f + "latch", "latching applies to threshold policies only")
            if on is not None or off is not None:
                raise SpecError(f + ("on" if on is not None else "off"), "belongs to a threshold policy")
            lo = _finite(-10.0 if min_scale is None else min_scale, f + "min_scale")
            hi = _finite(10.0 if max_scale is None else max_scale, f + "max_scale")
            if lo > hi:
                raise SpecError(f + "max_scale", f"must be >= min_scale ({lo}), got {hi}")
            init = _finite(initial_scale, f + "initial_scale")
            if not lo <= init <= hi:
                raise SpecError(f + "initial_scale", f"must lie in [min_scale, max_scale] = [{lo}, {hi}]")
            kw.update(target=_finite(target, f + "target"), gain=_finite(gain, f + "gain"), min_scale=lo, max_scale=hi,
                      initial_scale=init)
        return cls(probe, mode, site_t, vec, vector_name, component, latch=latch, **kw)

    @classmethod
    def from_json(cls, data: Any, field_name: str = "policy") -> "Policy":
        """From the API's JSON object (the same field names as `make`)."""
        if isinstance(data, Policy):
            return data
        if not isinstance(data, dict):
            raise SpecError(field_name, "must be an object")
        allowed = {"probe", "mode", "sites", "vector", "vector_name", "component", "on", "off", "min_hold", "scale",
                   "latch", "target", "gain", "min_scale", "max_scale", "initial_scale"}
        extra = sorted(set(data) - allowed)
        if extra:
            raise SpecError(f"{field_name}.{extra[0]}", "unknown field")
        return cls.make(**{k: v for k, v in data.items() if v is not None}, field_name=field_name)

    def check(self, num_layers: int, hidden_size: int, probe_of, vector_dims, field_name: str = "policy") -> None:
        """Against the model and the registries (`probe_of(name) -> Probe | None`,
        `vector_dims(name) -> int | None`)."""
        f = field_name + "."
        probe = probe_of(self.probe)
        if probe is None:
            raise SpecError(f + "probe", f"no registered probe named {self.probe!r}")
        if self.component >= probe.size:
            raise SpecError(f + "component", f"probe {self.probe!r} has {probe.size} score(s); component {self.component} does not exist")
        for j, s in enumerate(self.sites):
            check_site(s, num_layers, f"{f}sites[{j}]")
        if self.vector is not None and self.vector.shape[0] != hidden_size:
            raise SpecError(f + "vector", f"has dimension {self.vector.shape[0]}, the model's hidden size is {hidden_size}")
        if self.vector_name is not None:
            d = vector_dims(self.vector_name)
            if d is None:
                raise SpecError(f + "vector_name", f"no registered vector named {self.vector_name!r}")
            if d != hidden_size:
                raise SpecError(f + "vector_name", f"vector {self.vector_name!r} has dimension {d}, the model's hidden size is {hidden_size}")

    def to_json(self) -> dict:
        d: dict[str, Any] = {"probe": self.probe, "mode": self.mode, "sites": [str(s) for s in self.sites],
                             "component": self.component}
        if self.vector is not None:
            d["vector"] = encode_vector(self.vector)
        else:
            d["vector_name"] = self.vector_name
        if self.mode == "threshold":
            d.update(on=self.on, off=self.release_at, min_hold=self.min_hold, scale=self.scale, latch=self.latch)
        else:
            d.update(target=self.target, gain=self.gain, min_scale=self.min_scale, max_scale=self.max_scale,
                     initial_scale=self.initial_scale)
        return d

    def to_api(self) -> dict:
        """JSON for listings (vector as a list of floats)."""
        d = self.to_json()
        if "vector" in d:
            d["vector"] = self.vector.tolist()
        return d


def policy_from_wire(data: dict) -> Policy:
    """The worker's parse of `Policy.to_json` (already validated by the engine)."""
    vec = decode_vector(data["vector"]) if data.get("vector") is not None else None
    kw = {k: data[k] for k in ("on", "off", "min_hold", "scale", "latch", "target", "gain", "min_scale", "max_scale",
                               "initial_scale") if k in data}
    return Policy(data["probe"], data["mode"], tuple(Site.parse(s) for s in data["sites"]), vec, data.get("vector_name"),
                  int(data.get("component", 0)), **kw)


@dataclass(frozen=True)
class DynamicRequest:
    """What one generation request asks of dynamic steering: its own policies (besides the
    engine's global ones) and the conversation it belongs to (for `latch: conversation`)."""

    policies: tuple[Policy, ...] = ()
    conversation_id: str | None = None
    #: also apply the engine's global policies to this request
    use_global: bool = True
    #: the reference fork's declarative gates (`engine_ext.dynamic.gates.GateSet`), or None
    gates: Any = None

    @classmethod
    def make(cls, policies: Any = (), conversation_id: Any = None, use_global: bool = True,
             field_name: str = "dynamic") -> "DynamicRequest":
        items = list(policies or ())
        if len(items) > MAX_POLICIES:
            raise SpecError(f"{field_name}.policies", f"at most {MAX_POLICIES} policies per request")
        pols = tuple(Policy.from_json(p, f"{field_name}.policies[{k}]") for k, p in enumerate(items))
        if conversation_id is not None:
            check_name(conversation_id, f"{field_name}.conversation_id")
        return cls(pols, conversation_id, bool(use_global))

    def wire(self, global_policies: tuple[Policy, ...] = ()) -> dict:
        pols = (list(global_policies) if self.use_global else []) + list(self.policies)
        out = {"policies": [p.to_json() for p in pols], "conversation_id": self.conversation_id}
        if self.gates is not None:
            out["gates"] = self.gates.to_json()
        return out

"""The reference fork's declarative steering gates (`when x scope x apply`) as causalboard dynamic
steering: plain data (`Gate`, `GateSet`), its wire form, and the decision rule (`GateState`), a pure
function shared by the worker and the test oracle so both decide exactly alike.

A request's gates are decided together, with the fork's timing (its
`DeclarativeSteeringConsumer.on_step`):

* Gates are evaluated only at generated positions (the fork's decode phase): the first evaluation
  scores position `n_prompt` (the first generated token fed back), so the earliest steered
  position is `n_prompt + 1`. Until the request is *armed*, every position is evaluated; once it
  is armed the gates are never evaluated again (a later firing of another gate changes nothing).
* At the evaluation that arms the request, every firing gate acts: `always` fires; a `probe`
  trigger with scope `this_token` fires (its per-token condition is then applied token by token);
  any other `probe` trigger fires when `sigmoid(sharpness * (score - threshold)) > 0.5` in fp32
  (the score is the probe's projection of the stream at its site; `sharpness` 0 counts as 1, as
  in the fork).
* `add` gates that fire add `strength * steer` at their sites from the next position on. Their
  lifetime is the widest scope among them: `next_step` alone is a one-position pulse (the
  attenuation that fired with it ends with it); anything else lasts to the end of the request.
  `rest_of_conversation` additionally latches (by reference: name and content digest) for later
  requests of the conversation; that latch is kept by the caller (`GateSet.bridge`: a latched
  conversation's later request is steered with the latched vectors from its first evaluation on,
  and its own gates are not evaluated, as in the fork).
* `this_token` with a `probe` trigger (the fork's per-row in-graph monitor; the first such `add`
  gate of the request carries it, `GateSet.row_gate`): while the request's gate components are
  applied (every generated position after arming), at the probe's site only, the request's row
  term there (`GateSet.row_term`: its own static decode steering plus every component's
  `scale * vector` at that site) is scaled by `g = sigmoid(sharpness * (score - threshold))` of
  the *same* position, the score read from the stream at that site before the edit. That is
  computed in the intervention op (a row gate, see `engine_ext.worker.intervention_op`), not
  here: `decide` only arms the gate, its scales carry no soft factor.
* `attenuate` (the last firing one wins) multiplies the request's own static decode steering
  (`GateSet.static`) and the firing `add` gates by `max(0, strength)`.

Components (what the worker applies, in this order): each bridge part, each `add` gate, then the
attenuation of the static steering (its vectors with scale `a - 1`). `GateState.decide` returns one
scale per component for the next position.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine_ext.dynamic.specs import Probe
from engine_ext.errors import SpecError
from engine_ext.sites import Site
from engine_ext.specs import decode_vector, encode_vector

SCOPES = ("this_token", "next_step", "rest_of_request", "rest_of_conversation")
SCOPE_RANK = {s: k for k, s in enumerate(SCOPES)}
WHENS = ("always", "probe")
APPLIES = ("add", "attenuate")
#: gates per request at most
MAX_GATES = 16


@dataclass(frozen=True, eq=False)
class SiteVectors:
    """Vectors at sites (one per site), e.g. a fork steer vector `{hook: {layer: vec}}`."""

    sites: tuple[Site, ...]
    vectors: tuple[np.ndarray, ...]

    def to_json(self) -> dict:
        return {"sites": [str(s) for s in self.sites], "vectors": [encode_vector(v) for v in self.vectors]}

    @classmethod
    def from_wire(cls, data: dict) -> "SiteVectors":
        return cls(tuple(Site.parse(s) for s in data["sites"]), tuple(decode_vector(v) for v in data["vectors"]))

    def check(self, num_layers: int, hidden: int, field_name: str) -> None:
        for s, v in zip(self.sites, self.vectors):
            if s.layer >= num_layers:
                raise SpecError(field_name, f"layer {s.layer} is out of range: the model has layers 0..{num_layers - 1}")
            if v.shape != (hidden,):
                raise SpecError(field_name, f"has dimension {v.shape[-1]}, the model's hidden size is {hidden}")


@dataclass(frozen=True, eq=False)
class Gate:
    """One fork gate, resolved (vectors unpacked; the probe as a direction `Probe` with bias 0)."""

    scope: str
    when: str = "always"
    probe: Probe | None = None
    threshold: float = 0.0
    sharpness: float = 1.0
    apply: str = "add"
    strength: float = 1.0
    steer: SiteVectors | None = None
    #: (name, content digest) of a named steer source (a rest_of_conversation latch persists it)
    steer_ref: tuple[str, str] | None = None

    def __post_init__(self) -> None:
        if self.scope not in SCOPES or self.when not in WHENS or self.apply not in APPLIES:
            raise SpecError("steering", f"bad gate {self.scope}/{self.when}/{self.apply}")
        if (self.when == "probe") != (self.probe is not None):
            raise SpecError("steering", "a probe trigger needs its probe")
        if (self.apply == "add") != (self.steer is not None):
            raise SpecError("steering", "an add gate needs its steer vectors")
        if self.when == "probe" and self.apply == "attenuate" and self.scope == "this_token":
            raise SpecError("steering", "attenuate with when=probe and scope=this_token is not supported")
        for name in ("threshold", "sharpness", "strength"):
            if not math.isfinite(getattr(self, name)):
                raise SpecError("steering", f"{name} must be finite")

    @property
    def soft(self) -> bool:
        """A per-token soft gate (`this_token` with a probe trigger)."""
        return self.when == "probe" and self.scope == "this_token"

    @property
    def sharp(self) -> float:
        """The sharpness the fork uses (`sharpness or 1.0`: 0 counts as 1)."""
        return self.sharpness or 1.0

    def to_json(self) -> dict:
        d: dict[str, Any] = {"scope": self.scope, "when": self.when, "apply": self.apply, "strength": self.strength}
        if self.probe is not None:
            d.update(probe=self.probe.to_json(), threshold=self.threshold, sharpness=self.sharpness)
        if self.steer is not None:
            d["steer"] = self.steer.to_json()
        if self.steer_ref is not None:
            d["steer_ref"] = list(self.steer_ref)
        return d

    @classmethod
    def from_wire(cls, d: dict) -> "Gate":
        return cls(d["scope"], d["when"], Probe.from_wire(d["probe"]) if d.get("probe") else None,
                   float(d.get("threshold", 0.0)), float(d.get("sharpness", 1.0)), d["apply"], float(d["strength"]),
                   SiteVectors.from_wire(d["steer"]) if d.get("steer") else None,
                   tuple(d["steer_ref"]) if d.get("steer_ref") else None)


@dataclass(frozen=True, eq=False)
class GateSet:
    """A request's gates, its own static decode steering (what `attenuate` damps) and, for a
    later request of a latched conversation, the latched vectors (`bridge`: (vectors, strength)
    parts)."""

    gates: tuple[Gate, ...] = ()
    static: SiteVectors | None = None
    bridge: tuple[tuple[SiteVectors, float], ...] = ()

    def components(self) -> list[tuple[SiteVectors, str]]:
        """What the worker applies, in order: (vectors, role) with role `bridge`, `add:<k>`
        or `attenuate`."""
        out: list[tuple[SiteVectors, str]] = [(sv, "bridge") for sv, _ in self.bridge]
        out += [(g.steer, f"add:{k}") for k, g in enumerate(self.gates) if g.apply == "add"]
        if self.static is not None and self.static.sites and any(g.apply == "attenuate" for g in self.gates):
            out.append((self.static, "attenuate"))
        return out

    @property
    def row_gate(self) -> int | None:
        """The index of the gate whose probe gates the request's row per token (the fork installs
        one per-row monitor: its first `this_token` + probe `add` gate), or None."""
        for k, g in enumerate(self.gates):
            if g.soft and g.apply == "add":
                return k
        return None

    def row_term(self, scales: tuple[float, ...], site: Site) -> np.ndarray | None:
        """The term the row gate scales at `site` for the component scales `scales`: the static
        decode steering there, then each component's `vector * f32(scale)` there in component
        order (fp32, the order the worker composes a slot's `c` in); None when nothing is there."""
        term = None
        parts: list[tuple[np.ndarray, float]] = []
        if self.static is not None:
            parts += [(v, 1.0) for st, v in zip(self.static.sites, self.static.vectors) if st == site]
        for (sv, _), scale in zip(self.components(), scales):
            if scale != 0.0:
                parts += [(v, scale) for st, v in zip(sv.sites, sv.vectors) if st == site]
        for v, scale in parts:
            add = (np.asarray(v, np.float32) * np.float32(scale)).astype(np.float32)
            term = add if term is None else term + add
        return term

    def probes(self) -> list[Probe]:
        """The gates' probes (distinct names)."""
        seen: dict[str, Probe] = {}
        for g in self.gates:
            if g.probe is not None:
                seen.setdefault(g.probe.name, g.probe)
        return list(seen.values())

    def check(self, num_layers: int, hidden: int, field_name: str = "steering") -> None:
        for k, g in enumerate(self.gates):
            if g.probe is not None:
                g.probe.check(num_layers, hidden, f"{field_name}[{k}].when.probe")
            if g.steer is not None:
                g.steer.check(num_layers, hidden, f"{field_name}[{k}].apply.steer")
        if self.static is not None:
            self.static.check(num_layers, hidden, field_name)
        for sv, _ in self.bridge:
            sv.check(num_layers, hidden, "conversation_id")

    def to_json(self) -> dict:
        return {"gates": [g.to_json() for g in self.gates],
                "static": self.static.to_json() if self.static is not None else None,
                "bridge": [{"vectors": sv.to_json(), "strength": s} for sv, s in self.bridge]}

    @classmethod
    def from_wire(cls, d: dict) -> "GateSet":
        return cls(tuple(Gate.from_wire(g) for g in d.get("gates") or ()),
                   SiteVectors.from_wire(d["static"]) if d.get("static") else None,
                   tuple((SiteVectors.from_wire(b["vectors"]), float(b["strength"])) for b in d.get("bridge") or ()))


def sigmoid32(x: float) -> float:
    """`sigmoid(x)` in fp32 (the fork evaluates its gate with torch fp32)."""
    with np.errstate(over="ignore"):
        v = np.float32(1.0) / (np.float32(1.0) + np.exp(np.float32(-np.float32(x))))
    return float(v)


def gate_value(score: float, threshold: float, sharp: float) -> float:
    """The fork's gate `sigmoid(sharpness * (score - threshold))`, in fp32."""
    return sigmoid32(float(np.float32(sharp) * (np.float32(score) - np.float32(threshold))))


@dataclass
class GateState:
    """The decision rule of one request's `GateSet` (see the module docstring)."""

    gs: GateSet
    n_prompt: int
    armed_at: int | None = None
    bridged: bool = False
    pulse: bool = False
    expired: bool = False
    fired: tuple[int, ...] = ()
    attenuate: float | None = None
    scales: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        self.roles = [role for _, role in self.gs.components()]
        self.scales = (0.0,) * len(self.roles)

    @property
    def armed(self) -> bool:
        return self.armed_at is not None

    def current_scales(self) -> tuple[float, ...]:
        return self.scales

    def _compute(self) -> tuple[float, ...]:
        if self.expired or not self.armed:
            return (0.0,) * len(self.roles)
        a = 1.0 if self.attenuate is None else self.attenuate
        out = []
        for role in self.roles:
            if role == "bridge":
                out.append(0.0)  # filled below
            elif role == "attenuate":
                out.append(0.0 if self.attenuate is None else a - 1.0)
            else:
                k = int(role.split(":")[1])
                if k not in self.fired:
                    out.append(0.0)
                else:
                    out.append(self.gs.gates[k].strength * a)
        if self.bridged:
            parts = iter(s for _, s in self.gs.bridge)
            out = [next(parts) if role == "bridge" else v for role, v in zip(self.roles, out)]
        return tuple(out)

    def row_gated(self, scales: tuple[float, ...]) -> bool:
        """Does the row gate (`GateSet.row_gate`) act at a position with these component scales
        (the request's gate components applied there)?"""
        return (not self.bridged and self.gs.row_gate is not None and self.gs.row_gate in self.fired
                and any(v != 0.0 for v in scales))

    def decide(self, pos: int, scores: list[float | None]) -> tuple[float, ...]:
        """Update with the scores at position `pos` (one per gate, None for gates without a
        host-evaluated probe: `always`, and `this_token` probes, which fire when evaluated and
        gate in the op); return the component scales at position `pos + 1`."""
        if pos < self.n_prompt:  # the prompt (the fork's prefill phase): no evaluation
            return self.scales
        if self.armed:
            if self.pulse and not self.expired:
                self.expired = True  # the one-step pulse ends
        elif self.gs.bridge:
            self.armed_at, self.bridged = pos, True
        else:
            fired, rank, atten = [], -1, None
            for k, g in enumerate(self.gs.gates):
                if g.when == "probe" and not g.soft:
                    if scores[k] is None or not gate_value(scores[k], g.threshold, g.sharp) > 0.5:
                        continue
                if g.apply == "add":
                    fired.append(k)
                    rank = max(rank, SCOPE_RANK[g.scope])
                else:
                    atten = max(0.0, g.strength)
            if fired or atten is not None:
                self.armed_at, self.fired, self.attenuate = pos, tuple(fired), atten
                self.pulse = bool(fired) and rank == SCOPE_RANK["next_step"]
        self.scales = self._compute()
        return self.scales

    def latch_refs(self) -> list[list]:
        """The fired `rest_of_conversation` add gates' (name, digest, strength): what a
        conversation latches."""
        out = []
        for k in self.fired:
            g = self.gs.gates[k]
            if g.scope == "rest_of_conversation" and g.steer_ref is not None:
                out.append([g.steer_ref[0], g.steer_ref[1], g.strength])
        return out

    def summary(self) -> dict:
        return {"armed_at": self.armed_at, "bridged": self.bridged, "fired": list(self.fired),
                "attenuate": self.attenuate, "pulse": self.pulse, "latch": self.latch_refs()}

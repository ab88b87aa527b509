"""The reference fork's declarative steering gates (the `steering` field of `/v1/completions` and
`/v1/chat/completions`): its wire schema and validation, resolved into
`engine_ext.dynamic.gates.Gate`s that causalboard's dynamic steering runs.

Wire form (the fork's `vllm/v1/steering_schema.py`): a list of gates
`{"when": W, "scope": S, "apply": A}` with

* `W`: `{"kind": "always"}` | `{"kind": "probe", "probe": SRC, "threshold": t, "sharpness"?: 1.0}`;
* `S`: `this_token` | `next_step` | `rest_of_request` | `rest_of_conversation`;
* `A`: `{"kind": "add", "steer": SRC, "strength"?: 1.0}` | `{"kind": "attenuate", "strength": s}`
  (`{"kind": "clamp"}` is refused, as in the fork);
* `SRC`: `{"kind": "name", "name": N}` (the fork registry, `/v1/steering/vectors/register`: kind
  `probe` for a probe, `steer` for an add) | `{"kind": "inline", "packed": {hook: packed}}`.

Refused with a 400 naming the field (the fork's cases and messages): a non-list `steering`
(`steering`), a gate that is not an object (`steering[0]`), a bad or unknown source kind, an empty
name, an unknown name, an empty or malformed `packed`, a probe naming other than exactly one
(hook, layer) (`steering[0].when.probe`), a non-finite `threshold` or `sharpness`, a negative
`sharpness`, a `clamp` apply (`steering[0].apply.kind`), `attenuate` with a `probe` trigger and
scope `this_token` (`steering[0].scope`), an inline steer on a `rest_of_conversation` add
(`steering[0].apply.steer`: such a gate latches by reference to a registered name). Stricter than
the fork (it would run these, or drop the gates on the worker): unknown fields, non-finite
strengths, vectors of the wrong width or at layers the model lacks, the `post_mlp` hook.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import numpy as np

from engine_ext.dynamic.gates import MAX_GATES, SCOPES, Gate, SiteVectors
from engine_ext.dynamic.specs import Probe
from engine_ext.errors import SpecError
from engine_ext.sites import Site

from app.fork.vectors import finite_number, is_packed, parse_vector_spec

Rows = dict[tuple[str, int], np.ndarray]
#: (name, kind) -> (rows, content digest) | None: the fork registry's lookup
Resolver = Callable[[str, str], "tuple[Rows, str] | None"]

CLAMP_MESSAGE = ("per-request clamp gates (apply.kind='clamp') are not supported (as in the reference fork): "
                 "use steering_clamps for static clamps or causalboard's dynamic policies")
ATTENUATE_MESSAGE = ("attenuate with when=probe and scope=this_token is not supported: use scope=next_step or "
                     "rest_of_request (as in the reference fork)")
CONVERSATION_MESSAGE = ("rest_of_conversation steering persists server-side and requires a registered vector name; "
                        "register via /v1/steering/vectors/register or use rest_of_request")


def digest(rows: Rows) -> str:
    """Content digest of vectors at sites: sha256 over the sorted (hook, layer, fp32 bytes)."""
    h = hashlib.sha256()
    for (hook, layer), vec in sorted(rows.items()):
        h.update(f"{hook}:{layer}:".encode())
        h.update(np.ascontiguousarray(vec, dtype="<f4").tobytes())
    return h.hexdigest()


def packed_rows(packed: Any, field: str, kind: str, *, num_layers: int, hidden: int) -> Rows:
    """A `{hook: packed}` spec as {(hook, layer): float32 vector} (scales folded in), checked as
    the fork's registry does: known hooks, model layers, hidden size, finite values; a probe is
    exactly one row."""
    if not isinstance(packed, dict) or not packed:
        raise SpecError(field, f"{kind} vector must be a non-empty packed dict {{hook: packed}}")
    steers = parse_vector_spec(packed, field, phase="both", num_layers=num_layers, hidden=hidden)
    rows: Rows = {}
    for s in steers:
        (site,) = s.sites
        rows[(site.hook, site.layer)] = rows.get((site.hook, site.layer), 0) + s.vector.astype(np.float32) * np.float32(s.scale)
    if not rows:
        raise SpecError(field, f"{kind} vector decoded to no rows")
    if kind == "probe" and len(rows) != 1:
        raise SpecError(field, f"probe vector source must name exactly one (hook, layer); got "
                               f"{sorted((layer, hook) for hook, layer in rows)}")
    return rows


def _keys(obj: dict, allowed: set[str], field: str) -> None:
    extra = sorted(set(obj) - allowed)
    if extra:
        raise SpecError(f"{field}.{extra[0]}", "unknown field")


def _source(src: Any, field: str, kind: str, resolve: Resolver, num_layers: int, hidden: int
            ) -> tuple[Rows, str, str | None]:
    """A vector source -> (rows, content digest, registered name or None for inline)."""
    if not isinstance(src, dict):
        raise SpecError(field, f"vector source must be an object, got {type(src).__name__}")
    skind = src.get("kind")
    if skind == "name":
        _keys(src, {"kind", "name"}, field)
        name = src.get("name")
        if not isinstance(name, str) or not name:
            raise SpecError(f"{field}.name", "named vector source requires a non-empty 'name'")
        got = resolve(name, kind)
        if got is None:
            raise SpecError(f"{field}.name", f"unknown {kind} vector name {name!r} (register it with "
                                             f"/v1/steering/vectors/register, kind {kind!r})")
        rows, dig = got
        if kind == "probe" and len(rows) != 1:
            raise SpecError(field, f"probe vector source must name exactly one (hook, layer); got {len(rows)}")
        return rows, dig, name
    if skind == "inline":
        _keys(src, {"kind", "packed"}, field)
        packed = src.get("packed")
        if not isinstance(packed, dict) or not packed:
            raise SpecError(f"{field}.packed", "inline vector source requires a non-empty 'packed'")
        for hook, blob in packed.items():
            if not is_packed(blob):
                raise SpecError(f"{field}.packed.{hook}", "must be a packed blob {dtype, shape, layer_indices, data, scales?}")
        rows = packed_rows(packed, f"{field}.packed", kind, num_layers=num_layers, hidden=hidden)
        return rows, digest(rows), None
    raise SpecError(f"{field}.kind", f"vector source 'kind' must be 'name' or 'inline', got {skind!r}")


def site_vectors(rows: Rows) -> SiteVectors:
    items = sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][0]))
    return SiteVectors(tuple(Site(layer, hook) for (hook, layer), _ in items),
                       tuple(np.ascontiguousarray(v, np.float32) for _, v in items))


def _probe(rows: Rows, dig: str) -> Probe:
    """A single-row source as a direction probe with a content-addressed worker name ('~…')."""
    ((hook, layer), vec), = rows.items()
    w = np.ascontiguousarray(vec, np.float32)[None, :]
    return Probe(f"~{dig[:24]}", Site(layer, hook), "direction", w, np.zeros(1, np.float32))


def parse_gates(raw: Any, resolve: Resolver, *, num_layers: int, hidden: int, field: str = "steering") -> list[Gate] | None:
    """The `steering` field -> resolved gates (None for none: the fork treats an empty value as
    no gates). Raises `SpecError` naming the field."""
    if not raw:
        return None
    if not isinstance(raw, list):
        raise SpecError(field, "'steering' must be a list of gate objects")
    if len(raw) > MAX_GATES:
        raise SpecError(field, f"at most {MAX_GATES} gates per request, got {len(raw)}")
    gates = []
    for k, g in enumerate(raw):
        f = f"{field}[{k}]"
        if not isinstance(g, dict):
            raise SpecError(f, "each steering gate must be an object")
        _keys(g, {"when", "scope", "apply"}, f)
        for part in ("when", "scope", "apply"):
            if part not in g:
                raise SpecError(f"{f}.{part}", "required field is missing")
        gates.append(_gate(g, f, resolve, num_layers, hidden))
    return gates


def _gate(g: dict, f: str, resolve: Resolver, num_layers: int, hidden: int) -> Gate:
    when, scope, apply = g["when"], g["scope"], g["apply"]
    if scope not in SCOPES:
        raise SpecError(f"{f}.scope", f"must be one of {', '.join(SCOPES)}, got {scope!r}")
    if not isinstance(when, dict):
        raise SpecError(f"{f}.when", "must be an object {'kind': 'always' | 'probe', ...}")
    if not isinstance(apply, dict):
        raise SpecError(f"{f}.apply", "must be an object {'kind': 'add' | 'attenuate', ...}")
    probe = None
    threshold, sharpness = 0.0, 1.0
    if when.get("kind") == "always":
        _keys(when, {"kind"}, f"{f}.when")
    elif when.get("kind") == "probe":
        _keys(when, {"kind", "probe", "threshold", "sharpness"}, f"{f}.when")
        if "probe" not in when:
            raise SpecError(f"{f}.when.probe", "required field is missing")
        rows, dig, _ = _source(when["probe"], f"{f}.when.probe", "probe", resolve, num_layers, hidden)
        probe = _probe(rows, dig)
        if "threshold" not in when:
            raise SpecError(f"{f}.when.threshold", "required field is missing")
        threshold = finite_number(when["threshold"], f"{f}.when.threshold")
        sharpness = finite_number(when.get("sharpness", 1.0), f"{f}.when.sharpness")
        if sharpness < 0:
            raise SpecError(f"{f}.when.sharpness", f"probe sharpness must be non-negative, got {sharpness!r}")
    else:
        raise SpecError(f"{f}.when.kind", f"must be 'always' or 'probe', got {when.get('kind')!r}")
    kind = apply.get("kind")
    steer = ref = None
    if kind == "clamp":
        raise SpecError(f"{f}.apply.kind", CLAMP_MESSAGE)
    if kind == "add":
        _keys(apply, {"kind", "steer", "strength"}, f"{f}.apply")
        if "steer" not in apply:
            raise SpecError(f"{f}.apply.steer", "required field is missing")
        if scope == "rest_of_conversation" and isinstance(apply["steer"], dict) and apply["steer"].get("kind") == "inline":
            raise SpecError(f"{f}.apply.steer", CONVERSATION_MESSAGE)
        rows, dig, name = _source(apply["steer"], f"{f}.apply.steer", "steer", resolve, num_layers, hidden)
        steer = site_vectors(rows)
        ref = (name, dig) if name is not None else None
        strength = finite_number(apply.get("strength", 1.0), f"{f}.apply.strength")
    elif kind == "attenuate":
        _keys(apply, {"kind", "strength"}, f"{f}.apply")
        if "strength" not in apply:
            raise SpecError(f"{f}.apply.strength", "required field is missing")
        strength = finite_number(apply["strength"], f"{f}.apply.strength")
        if probe is not None and scope == "this_token":
            raise SpecError(f"{f}.scope", ATTENUATE_MESSAGE)
    else:
        raise SpecError(f"{f}.apply.kind", f"must be 'add', 'attenuate' or 'clamp', got {kind!r}")
    return Gate(scope, "probe" if probe is not None else "always", probe, threshold, sharpness,
                kind, strength, steer, ref)


def static_decode(steers) -> SiteVectors | None:
    """A request's own static decode steering per site (what `attenuate` damps): the sum of
    `scale * vector` of its inline steering entries that apply at every generated position (phase
    `both` or `decode`, positions `all`, no mask), in entry order, fp32."""
    sums: dict[Site, np.ndarray] = {}
    for s in steers:
        if s.vector is None or s.mask is not None or s.positions != "all" or s.phase not in ("both", "decode"):
            continue
        for site in s.sites:
            add = s.vector.astype(np.float32) * np.float32(s.scale)
            sums[site] = add if site not in sums else sums[site] + add
    if not sums:
        return None
    items = sorted(sums.items(), key=lambda kv: kv[0].index())
    return SiteVectors(tuple(site for site, _ in items), tuple(v for _, v in items))

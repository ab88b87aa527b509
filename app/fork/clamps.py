"""The reference fork's directional-clamp tiers, parsed into causalboard's `Clamp` specs.

One parser for every place the fork takes clamps: `steering_clamps` / `prefill_steering_clamps`
/ `decode_steering_clamps` on `/v1/completions` and `/v1/chat/completions`, and `clamps` /
`prefill_clamps` / `decode_clamps` on `/v1/steering/set`. A tier is any of the fork's three
accepted shapes (its `SteeringClamps.from_obj`):

* entry lists `{hook: {layer: [entry, ...]}}`, an entry being `{"vector": [...], "min"?, "max"?,
  "strength"?: 1.0}` or `{"vector": [...], "value": c}` (min = max = c);
* the canonical wire map `{"hooks": {hook: {"shape": [n, hidden], "layer_indices": [n],
  "data": base64 of float64 rows, "lo": [n], "hi": [n], "strength": [n]}}}` (null bound: open);
* the legacy packed form `{hook: {"dtype", "shape", "layer_indices", "data", "bounds": [[lo, hi]],
  "strengths": [n]}}`.

Every clamp acts at every position of its tier's phase (`vectors` tier: both, `prefill_`: the
prompt, `decode_`: generated tokens), as in the fork. The fork's rules are kept: at least one
bound, `value` exclusive with `min`/`max`, `min <= max`, `strength` in [0, 1], finite non-zero
directions of the model's width; each problem is a `SpecError` naming the field as the client
wrote it (`steering_clamps.post_block.3[0].min`).
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

import numpy as np

from engine_ext.errors import SpecError
from engine_ext.specs import Clamp
from engine_ext.sites import Site

from app.fork.vectors import check_hook, check_layer, decode_packed, packed_shape

#: fork clamp tiers -> the `phase` of the Clamp entries they become
COMPLETION_TIERS = {"steering_clamps": "both", "prefill_steering_clamps": "prefill", "decode_steering_clamps": "decode"}
GLOBAL_TIERS = {"clamps": "both", "prefill_clamps": "prefill", "decode_clamps": "decode"}
_WIRE_KEYS = {"shape", "layer_indices", "data", "lo", "hi", "strength"}

#: JSON schema of one tier (for OpenAPI; parsing is done here, field by field)
CLAMP_SPEC_SCHEMA: dict = {
    "type": "object",
    "description": "hook -> {layer: [{'vector': [floats], 'min'?: x, 'max'?: y, 'strength'?: 0..1} | "
                   "{'vector': [floats], 'value': c}]}; or {'hooks': {hook: {'shape', 'layer_indices', 'data' (base64 "
                   "float64), 'lo', 'hi', 'strength'}}}; or hook -> packed {'dtype', 'shape', 'layer_indices', 'data', "
                   "'bounds': [[lo, hi]], 'strengths'} (null bound: open)",
}


def _entry(entry: Any, f: str, site: Site, phase: str, hidden: int) -> Clamp:
    if not isinstance(entry, dict):
        raise SpecError(f, "a clamp entry is {'vector': [...], 'min'?, 'max'?, 'strength'?} or {'vector': [...], 'value': c}")
    extra = sorted(set(entry) - {"vector", "value", "min", "max", "strength"})
    if extra:
        raise SpecError(f"{f}.{extra[0]}", "unknown field in a clamp entry (vector, value, min, max, strength)")
    if "vector" not in entry:
        raise SpecError(f"{f}.vector", "required field is missing")
    return _clamp(site, entry["vector"], f, phase, hidden, lo=entry.get("min"), hi=entry.get("max"),
                  value=entry.get("value"), strength=entry.get("strength", 1.0))


def _clamp(site: Site, vector: Any, f: str, phase: str, hidden: int, *, lo: Any = None, hi: Any = None,
           value: Any = None, strength: Any = 1.0) -> Clamp:
    c = Clamp.make([site], vector, min=lo, max=hi, value=value, strength=strength, phase=phase, field_name=f)
    if c.vector.shape[0] != hidden:
        raise SpecError(f"{f}.vector", f"has dimension {c.vector.shape[0]}, the model's hidden size is {hidden}")
    return c


def _rows_f64(data: Any, f: str, n: int, hidden: int) -> np.ndarray:
    if not isinstance(data, str):
        raise SpecError(f, "must be a base64 string of float64 rows")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise SpecError(f, "is not valid base64") from None
    if len(raw) != n * hidden * 8:
        raise SpecError(f, f"holds {len(raw)} bytes; {n} float64 rows of {hidden} need {n * hidden * 8}")
    return np.frombuffer(raw, dtype="<f8").reshape(n, hidden)


def _list(value: Any, f: str, n: int) -> list:
    if not isinstance(value, list) or len(value) != n:
        raise SpecError(f, f"must be a list of {n} values (one per row)")
    return value


def parse_clamp_spec(spec: Any, field: str, *, phase: str, num_layers: int, hidden: int) -> list[Clamp]:
    """One fork clamp tier -> single-site `Clamp` entries at every position of `phase`, in the
    fork's order (hook by hook; layers ascending, entries in order within a layer)."""
    if spec is None:
        return []
    if not isinstance(spec, dict):
        raise SpecError(field, "must be an object {hook: {layer: [clamp entries]}}, {'hooks': {...}} or {hook: packed blob}")
    out: list[Clamp] = []
    if set(spec) == {"hooks"}:  # the fork's canonical wire map
        hooks = spec["hooks"]
        if not isinstance(hooks, dict):
            raise SpecError(f"{field}.hooks", "must be an object {hook: table}")
        for hook, table in hooks.items():
            hf = f"{field}.hooks.{hook}"
            check_hook(hook, hf)
            if not isinstance(table, dict) or set(table) != _WIRE_KEYS:
                raise SpecError(hf, f"a clamp table has exactly the fields {', '.join(sorted(_WIRE_KEYS))}")
            n, width = packed_shape(table["shape"], f"{hf}.shape", hidden)
            rows = _rows_f64(table["data"], f"{hf}.data", n, width)
            layers = _list(table["layer_indices"], f"{hf}.layer_indices", n)
            los, his, sts = (_list(table[k], f"{hf}.{k}", n) for k in ("lo", "hi", "strength"))
            out += _rows(rows, layers, los, his, sts, hf, hook, phase, num_layers, hidden,
                         lambda k: (f"{hf}.lo[{k}]", f"{hf}.hi[{k}]", f"{hf}.strength[{k}]"))
        return out
    for hook, per_hook in spec.items():
        hf = f"{field}.{hook}"
        check_hook(hook, hf)
        if isinstance(per_hook, dict) and "data" in per_hook and "dtype" in per_hook and "bounds" in per_hook:
            blob = {k: v for k, v in per_hook.items() if k not in ("bounds", "strengths")}
            extra = sorted(set(per_hook) - {"dtype", "shape", "data", "layer_indices", "bounds", "strengths"})
            if extra:
                raise SpecError(f"{hf}.{extra[0]}", "unknown field in a packed clamp blob")
            rows, layers, _ = decode_packed(blob, hf, hidden=hidden, with_layers=True)
            n = rows.shape[0]
            bounds = _list(per_hook["bounds"], f"{hf}.bounds", n)
            for k, pair in enumerate(bounds):
                if not isinstance(pair, list) or len(pair) != 2:
                    raise SpecError(f"{hf}.bounds[{k}]", "must be a [lo, hi] pair (null: open)")
            sts = _list(per_hook.get("strengths"), f"{hf}.strengths", n)
            out += _rows(rows, layers, [b[0] for b in bounds], [b[1] for b in bounds], sts, hf, hook, phase, num_layers,
                         hidden, lambda k: (f"{hf}.bounds[{k}]", f"{hf}.bounds[{k}]", f"{hf}.strengths[{k}]"))
            continue
        if not isinstance(per_hook, dict):
            raise SpecError(hf, "must be an object {layer: [clamp entries]} or a packed blob")
        by_layer: dict[int, tuple[str, Any]] = {}
        for layer_key, entries in per_hook.items():
            lf = f"{hf}.{layer_key}"
            layer = check_layer(layer_key, lf, num_layers)
            if layer in by_layer:
                raise SpecError(lf, f"layer {layer} appears twice")
            if not isinstance(entries, list):
                raise SpecError(lf, "must be a list of clamp entries")
            by_layer[layer] = (lf, entries)
        for layer in sorted(by_layer):
            lf, entries = by_layer[layer]
            out += [_entry(e, f"{lf}[{k}]", Site(layer, hook), phase, hidden) for k, e in enumerate(entries)]
    return out


def _rows(rows: np.ndarray, layers: list, los: list, his: list, sts: list, hf: str, hook: str, phase: str,
          num_layers: int, hidden: int, names) -> list[Clamp]:
    """Packed rows -> Clamp entries (layers ascending, row order kept within a layer)."""
    items = []
    for k in range(rows.shape[0]):
        layer = check_layer(layers[k], f"{hf}.layer_indices[{k}]", num_layers)
        items.append((layer, k))
    out = []
    for layer, k in sorted(items):
        lo_f, hi_f, st_f = names(k)
        lo, hi = los[k], his[k]
        if lo is None and hi is None:
            continue  # open on both sides: a no-op (the fork accepts it in these forms and changes nothing)
        try:
            out.append(_clamp(Site(layer, hook), rows[k], f"{hf}[{k}]", phase, hidden, lo=lo, hi=hi, strength=sts[k]))
        except SpecError as exc:
            raise SpecError(_field_of(exc.field, hf, k, lo_f, hi_f, st_f), exc.message) from None
    return out


def _field_of(field: str, hf: str, k: int, lo_f: str, hi_f: str, st_f: str) -> str:
    base = f"{hf}[{k}]"
    return {f"{base}.min": lo_f, f"{base}.max": hi_f, f"{base}.value": lo_f, f"{base}.strength": st_f,
            f"{base}.vector": f"{hf}.data"}.get(field, field)


def parse_tiers(obj: Any, tiers: dict[str, str], *, num_layers: int, hidden: int) -> tuple[list[Clamp], list[str]]:
    """Every clamp tier of `obj` (an object with the tier attributes) -> (Clamp entries in tier
    order, each one's request field for relabelled errors)."""
    out: list[Clamp] = []
    origins: list[str] = []
    for tier, phase in tiers.items():
        for c in parse_clamp_spec(getattr(obj, tier), tier, phase=phase, num_layers=num_layers, hidden=hidden):
            out.append(c)
            origins.append(f"{tier}.{c.sites[0].hook}.{c.sites[0].layer}")
    return out, origins

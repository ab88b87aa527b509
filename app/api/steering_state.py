"""Global steering as the HTTP API shows and edits it (on top of `Engine.set_global_steer`).

* `merge_steers(current, new)` — the fork's `replace: false`: an entry of `new` replaces the
  current steering at the same (site, phase); everything else is kept (multi-site entries lose
  only the replaced sites). Kept entries come first, new ones after, in request order.
* `describe(steers, engine)` — the fork's `active_layers` view (non-zero norms per layer, hook and
  phase, rounded to 6 decimals) plus
  the native entries (`ActiveSteer`), which can be POSTed back as `steer`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from engine_ext import Engine
from engine_ext.specs import Clamp, Steer, positions_to_json
from engine_ext.sites import HOOKS


def merge_steers(current: Sequence[Steer | Clamp], new: Sequence[Steer | Clamp]) -> list:
    """Also merges clamps (`merge_steers(current_clamps, new_clamps)`): the fork replaces a tier's
    clamps at a (hook, layer) by the new ones there."""
    replaced = {(site, s.phase) for s in new for site in s.sites}
    kept = []
    for s in current:
        sites = tuple(site for site in s.sites if (site, s.phase) not in replaced)
        if sites == s.sites:
            kept.append(s)
        elif sites:
            kept.append(dataclasses.replace(s, sites=sites))
    return kept + list(new)


def steer_vector(s: Steer, engine: Engine) -> np.ndarray | None:
    """The entry's unscaled vector (inline, or the named vector's current value)."""
    if s.vector is not None:
        return s.vector
    return engine.named_vector(s.name) if s.name is not None else None


def describe(steers: Sequence[Steer], engine: Engine, clamps: Sequence[Clamp] = ()) -> dict:
    """`{"active_layers": {layer: {hook: {"norm", "prefill_norm"?, "decode_norm"?}}}, "steer": [...],
    "clamp": [...]}`."""
    hidden = engine.info.hidden_size
    sums: dict[tuple[int, str, str], np.ndarray] = {}
    entries = []
    for s in steers:
        vec = steer_vector(s, engine)
        scaled = (vec.astype(np.float64) * s.scale) if vec is not None else np.zeros(hidden)
        for site in s.sites:
            key = (site.layer, site.hook, s.phase)
            sums[key] = sums.get(key, np.zeros(hidden)) + scaled
        entries.append({"sites": [str(site) for site in s.sites],
                        "vector": s.vector.tolist() if s.vector is not None else None,
                        "name": s.name, "scale": s.scale, "positions": positions_to_json(s.positions),
                        "phase": s.phase, "norm": float(np.linalg.norm(scaled))})
    # the fork's view: per layer and hook, the norm of each phase's summed vector, rounded to 6
    # decimals; a zero sum is left out (and a layer or hook with nothing left), as the fork does
    active: dict[str, dict[str, dict[str, float]]] = {}
    for (layer, hook, phase), total in sorted(sums.items(), key=lambda kv: (kv[0][0], HOOKS.index(kv[0][1]), kv[0][2])):
        norm = float(np.linalg.norm(total))
        if norm > 0.0:
            norms = active.setdefault(str(layer), {}).setdefault(hook, {})
            norms["norm" if phase == "both" else f"{phase}_norm"] = round(norm, 6)
    clamp_entries = [{"sites": [str(site) for site in c.sites], "vector": c.vector.tolist(), "min": c.min, "max": c.max,
                      "strength": c.strength, "positions": positions_to_json(c.positions), "phase": c.phase} for c in clamps]
    return {"active_layers": active, "steer": entries, "clamp": clamp_entries}


def active_sites(steers: Sequence[Steer | Clamp]) -> list[str]:
    """Every site the steering touches, in layer/hook order."""
    return [str(site) for site in sorted({site for s in steers for site in s.sites}, key=lambda x: (x.layer, HOOKS.index(x.hook)))]

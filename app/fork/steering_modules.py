"""The reference fork's steering *modules*, mapped onto named vectors.

A module is a named set of per-(hook, layer) vectors in up to three tiers (`vectors` = both
phases, `prefill_vectors`, `decode_vectors`). causalboard stores each as a named vector
`module/<name>/<phase>/L<layer>.<hook>` (phase: both | prefill | decode), so modules live on
the engine like any named vector, count against its named-vector limit, and are listed by
parsing those names. A scale is folded into the stored vector (the fork does the same).

A module may also carry directional clamps (the fork's `clamps` / `prefill_clamps` /
`decode_clamps` tiers; a module may hold only clamps). They are kept beside the engine's named
vectors for the engine's lifetime (`_CLAMPS`, per engine), not as named vectors: a clamp is a
direction with bounds, not a vector to add.

Uses: `steering_name: <module>` on `/v1/completions` steers with every vector of the module at
every position of its phase (scale 1.0, as in the fork) and applies its clamps before the
request's own (the fork's order); `source_module: <module>` in a fork patch entry reads the
module's both-phase vector at the patched site.
"""

from __future__ import annotations

import re
import threading
import weakref
from collections.abc import Sequence

import numpy as np

from engine_ext import Engine
from engine_ext.errors import SpecError
from engine_ext.specs import Clamp, Steer
from engine_ext.sites import Site

PREFIX = "module/"
_NAME_RE = re.compile(r"^[\w.\-:]{1,64}$")
_VECTOR_RE = re.compile(r"^module/([\w.\-:]{1,64})/(both|prefill|decode)/(L\d+\.\w+)$")
#: each engine's module clamps: {module name: [Clamp, ...]} (tier order: both, prefill, decode)
_CLAMPS: "weakref.WeakKeyDictionary[Engine, dict[str, list[Clamp]]]" = weakref.WeakKeyDictionary()
_CLAMPS_LOCK = threading.Lock()


def clamps_of(engine: Engine, name: str) -> list[Clamp]:
    """The module's clamps (empty when it has none or does not exist)."""
    with _CLAMPS_LOCK:
        return list(_CLAMPS.get(engine, {}).get(name, ()))


def _set_clamps(engine: Engine, name: str, clamps: Sequence[Clamp]) -> None:
    with _CLAMPS_LOCK:
        table = _CLAMPS.setdefault(engine, {})
        if clamps:
            table[name] = list(clamps)
        else:
            table.pop(name, None)


def check_module_name(name: str, field: str = "name") -> str:
    if not _NAME_RE.match(name):
        raise SpecError(field, "a module name is 1-64 characters of letters, digits, '_', '-', '.', ':'")
    return name


def vector_name(module: str, phase: str, site: Site) -> str:
    return f"{PREFIX}{module}/{phase}/{site}"


def modules(engine: Engine) -> dict[str, list[tuple[Site, str, str]]]:
    """module name -> [(site, phase, vector name)], from the engine's named vectors (a module of
    clamps only is listed with no vectors)."""
    out: dict[str, list[tuple[Site, str, str]]] = {}
    for name in sorted(engine.list_vectors()):
        m = _VECTOR_RE.match(name)
        if m:
            out.setdefault(m.group(1), []).append((Site.parse(m.group(3)), m.group(2), name))
    with _CLAMPS_LOCK:
        for name in _CLAMPS.get(engine, {}):
            out.setdefault(name, [])
    return dict(sorted(out.items()))


def register(engine: Engine, name: str, steers: Sequence[Steer], clamps: Sequence[Clamp] = ()) -> None:
    """Store `steers` (single-site entries) and `clamps` as module `name`, replacing a module of
    that name. Refused as a whole (SpecError) if the named-vector limit would be exceeded."""
    check_module_name(name)
    if not steers and not clamps:
        raise SpecError("vectors", "a module needs at least one vector or clamp (vectors, prefill_vectors, decode_vectors, "
                                   "clamps, prefill_clamps or decode_clamps)")
    wanted: dict[str, np.ndarray] = {}
    for s in steers:
        (site,) = s.sites
        vname = vector_name(name, s.phase, site)
        wanted[vname] = wanted.get(vname, 0) + s.vector.astype(np.float32) * np.float32(s.scale)
    old = {v for _, _, v in modules(engine).get(name, [])}
    limit = engine.config.limits.max_named_vectors
    after = len(set(engine.list_vectors()) - old) + len(wanted)
    if after > limit:
        raise SpecError("vectors", f"the module needs {len(wanted)} named vectors; with the {after - len(wanted)} others "
                                   f"that exceeds the limit of {limit} named vectors")
    for vname in sorted(old - set(wanted)):
        engine.delete_vector(vname)
    for vname, vec in wanted.items():
        engine.register_vector(vname, vec)
    _set_clamps(engine, name, clamps)


def unregister(engine: Engine, name: str) -> bool:
    """Delete every vector and clamp of module `name`; False if there was none."""
    mods = modules(engine)
    if name not in mods:
        return False
    for _, _, vname in mods[name]:
        engine.delete_vector(vname)
    _set_clamps(engine, name, ())
    return True


def steers_of(engine: Engine, name: str, field: str) -> list[Steer]:
    """Steering with module `name` (every vector, every position of its phase, scale 1)."""
    entries = modules(engine).get(name)
    if entries is None:
        raise SpecError(field, f"no steering module named {name!r}")
    return [Steer((site,), None, vname, 1.0, "all", phase) for site, phase, vname in entries]


def source_vector(engine: Engine, name: str, site: Site) -> np.ndarray | None:
    """The vector a fork `source_module` denotes at `site`: the module's both-phase vector there,
    else the plain named vector `name`; None when neither exists."""
    vec = engine.named_vector(vector_name(name, "both", site))
    if vec is None and not name.startswith(PREFIX):
        vec = engine.named_vector(name)
    return vec

"""Re-label a `SpecError` raised by the engine with the request field the client wrote.

The engine names fields of the spec it was given (`steer[3].sites[0]`, `capture.positions`); a
route that built that spec from differently named request fields (the fork's `vectors.post_block.3`,
a capture request's top-level `positions`) maps the name back with `rename`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

from engine_ext.errors import SpecError

_INDEXED = re.compile(r"^(\w+)\[(\d+)\](.*)$")


def rename(exc: SpecError, new_field: str) -> SpecError:
    if new_field == exc.field:
        return exc
    return SpecError(new_field, exc.message)


def by_prefix(exc: SpecError, mapping: dict[str, str]) -> SpecError:
    """Replace a leading field name: with `{"capture": ""}`, `capture.positions[0]` becomes
    `positions[0]`; with `{"steer": "interventions.steer"}`, `steer[2].vector` becomes
    `interventions.steer[2].vector`. The longest matching name wins."""
    for old in sorted(mapping, key=len, reverse=True):
        f = exc.field
        if f == old or f.startswith(old + ".") or f.startswith(old + "["):
            new = (mapping[old] + f[len(old):]).lstrip(".")
            return rename(exc, new or f)
    return exc


def by_index(exc: SpecError, list_name: str, origins: Sequence[str], offset: int = 0,
             suffix: Callable[[str], str] = lambda rest: rest) -> SpecError:
    """`list_name[k]<rest>` -> `origins[k - offset]<suffix(rest)>` (when k - offset is in range)."""
    m = _INDEXED.match(exc.field)
    if not m or m.group(1) != list_name:
        return exc
    k = int(m.group(2)) - offset
    if not 0 <= k < len(origins):
        return exc
    return rename(exc, origins[k] + suffix(m.group(3)))

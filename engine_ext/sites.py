"""The one vocabulary of sites, positions and selectors (pure Python: no numpy, no vLLM).

Every other module — engine, worker, oracle, API, client, CLI, dashboard, figures — takes hooks,
site names, keys and selector syntax from here.

Sites
-----
A site is `(layer, hook)`. Hooks are points of decoder layer `i` (see docs/concepts.md):

* `pre_attn`   — the residual stream entering layer i (HF `hidden_states[i]`);
* `post_attn`  — the stream after the attention add of layer i;
* `mlp_in`     — the MLP's input: the output of the post-attention norm, what the MLP reads
  (a branch tensor, not the residual stream);
* `mlp_out`    — the MLP's output, before it is added to the residual stream (a branch
  tensor: `post_block = post_attn + mlp_out` in an unmodified run);
* `post_block` — the stream leaving layer i (HF `hidden_states[i+1]`; for the last layer the
  value before the final norm).

`RESIDUAL_HOOKS` are the three residual-stream hooks; `BRANCH_HOOKS` the two MLP-branch hooks.
Every hook is `hidden_size` wide, and every intervention (steer, patch, capture) works at each.

Canonical text form `L{layer}.{hook}` (`site_name`, `Site.__str__`, `Site.parse`), e.g.
`L3.post_attn`: the same string in the API, capture keys, figure labels and docs. Internally a
site is also a flat index `layer * SITES_PER_LAYER + HOOK_INDEX[hook]` into per-site buffers.

Keys
----
A value at one site and one token position is keyed `SitePosition(layer, hook, position)` — in
that order everywhere (captures, sweep cells, figures).

Selector text
-------------
What a person types in the dashboard's fields, on the command line and in docs:

* layers: `all` (or empty) = every layer; a comma-separated mix of `N`, `A-B` (inclusive) and
  `A:B` / `A:B:S` (Python range: stop exclusive) — `0-5`, `0,2,4`, `0:6:2`;
* positions: `all` / `all_prompt` (or empty) = every prompt token; a comma-separated mix of
  token indices, `A-B` ranges (inclusive) and `span:TEXT` / `span:TEXT#N` (the tokens of the
  N-th, 0-based, occurrence of TEXT) — `3,4`, `0-5`, `span:Garrow`, `span:the#1`;
* a span on its own (a subject or noise span): `TEXT` or `TEXT#N`.

`parse_layers` / `parse_positions` / `parse_span` turn them into the JSON forms the API takes;
`format_layers` / `format_positions` write them back. Bad text raises `SpecError` naming the
field.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any, NamedTuple

from engine_ext.errors import SpecError

#: hooks of a decoder layer, in the order the forward computes them (the order of the per-site
#: buffers and of figures)
HOOKS: tuple[str, ...] = ("pre_attn", "post_attn", "mlp_in", "mlp_out", "post_block")
#: the hooks on the residual stream, and those on the MLP branch (see the module docstring)
RESIDUAL_HOOKS: tuple[str, ...] = ("pre_attn", "post_attn", "post_block")
BRANCH_HOOKS: tuple[str, ...] = ("mlp_in", "mlp_out")
HOOK_INDEX: dict[str, int] = {h: i for i, h in enumerate(HOOKS)}
SITES_PER_LAYER = len(HOOKS)
#: what each hook is, for forms, tooltips and the OpenAPI page
HOOK_DOCS: dict[str, str] = {
    "pre_attn": "residual stream entering the layer",
    "post_attn": "residual stream after the attention add",
    "mlp_in": "MLP input (after the post-attention norm)",
    "mlp_out": "MLP output, before its residual add",
    "post_block": "residual stream leaving the layer",
}
NAMED_POSITIONS: tuple[str, ...] = ("last_prompt", "all_prompt", "all_generated", "all")
PHASES: tuple[str, ...] = ("both", "prefill", "decode")

_SITE_RE = re.compile(r"^L(\d+)\.(\w+)$")


def check_hook(hook: Any, field_name: str = "hook") -> str:
    """`hook` if it is one of `HOOKS`; SpecError naming `field_name` otherwise."""
    if hook not in HOOK_INDEX:
        raise SpecError(field_name, f"unknown hook {hook!r}; expected one of {', '.join(HOOKS)}")
    return hook


def site_name(layer: int, hook: str) -> str:
    """The canonical text of a site: `L{layer}.{hook}`."""
    return f"L{layer}.{hook}"


@dataclass(frozen=True, order=True)
class Site:
    layer: int
    hook: str

    def __post_init__(self) -> None:
        check_hook(self.hook)
        if not isinstance(self.layer, int) or isinstance(self.layer, bool) or self.layer < 0:
            raise SpecError("layer", f"must be a non-negative integer, got {self.layer!r}")

    def __str__(self) -> str:
        return site_name(self.layer, self.hook)

    @classmethod
    def parse(cls, text: str) -> "Site":
        m = _SITE_RE.match(text.strip())
        if not m:
            raise SpecError("site", f"{text!r} is not a site; write it as L<layer>.<hook>, e.g. L3.post_attn")
        return cls(int(m.group(1)), m.group(2))

    def index(self) -> int:
        """Flat index into the per-site buffers."""
        return site_index(self.layer, self.hook)

    @property
    def sort_key(self) -> tuple[int, int]:
        """(layer, hook in stream order): the order of figures and listings."""
        return self.layer, HOOK_INDEX[self.hook]


def site_index(layer: int, hook: str) -> int:
    return layer * SITES_PER_LAYER + HOOK_INDEX[hook]


@functools.lru_cache(maxsize=4096)
def site_from_index(index: int) -> Site:
    """The site of a flat index (cached: `Site` is immutable, and result conversion calls this
    once per captured value)."""
    return Site(index // SITES_PER_LAYER, HOOKS[index % SITES_PER_LAYER])


class SitePosition(NamedTuple):
    """The key of a value at one site and one token position."""

    layer: int
    hook: str
    position: int


@dataclass(frozen=True)
class Span:
    """The tokens overlapping the `occurrence`-th (0-based) occurrence of `text` in the prompt."""

    text: str
    occurrence: int = 0

    def to_json(self) -> dict:
        return {"span": self.text, "occurrence": self.occurrence}


# ---- selector text -------------------------------------------------------------------------------
def _parts(text: str, field_name: str) -> list[str]:
    parts = [p.strip() for p in text.split(",")]
    if any(not p for p in parts):
        raise SpecError(field_name, "empty entry between commas")
    return parts


def _int_or_range(part: str, field_name: str, *, spans: bool) -> list[int]:
    m = re.fullmatch(r"(\d+)\s*-\s*(\d+)", part)
    if m:
        a, b = int(m.group(1)), int(m.group(2))
        if b < a:
            raise SpecError(field_name, f"range {part!r} runs backwards")
        return list(range(a, b + 1))
    m = re.fullmatch(r"(\d+)?:(\d+)(?::(\d+))?", part)
    if m:
        start, stop, step = int(m.group(1) or 0), int(m.group(2)), int(m.group(3) or 1)
        if step < 1 or stop <= start:
            raise SpecError(field_name, f"{part!r}: start:stop:step needs stop > start and step >= 1")
        return list(range(start, stop, step))
    if re.fullmatch(r"-?\d+", part) and (spans or not part.startswith("-")):
        return [int(part)]
    raise SpecError(field_name, f"{part!r} is not a number, a range A-B or A:B[:S]" + (", or span:TEXT[#N]" if spans else ""))


def parse_layers(text: str, field_name: str = "layers") -> list[int] | None:
    """Layer selector text -> sorted layer numbers, or None for every layer."""
    t = text.strip().lower()
    if t in ("", "all"):
        return None
    out: list[int] = []
    for part in _parts(t, field_name):
        out.extend(_int_or_range(part, field_name, spans=False))
    return sorted(dict.fromkeys(out))


def parse_span(text: str, field_name: str = "span") -> dict:
    """`TEXT` or `TEXT#N` -> `{"span": TEXT, "occurrence": N}` (a `#` followed by anything but
    digits is part of the text)."""
    span, occurrence = text, 0
    m = re.fullmatch(r"(.*)#(\d+)", text, flags=re.S)
    if m:
        span, occurrence = m.group(1), int(m.group(2))
    if not span.strip():
        raise SpecError(field_name, "a span needs text, e.g. Garrow or the#1")
    return {"span": span, "occurrence": occurrence}


def parse_positions(text: str, field_name: str = "positions") -> str | list:
    """Position selector text -> `"all_prompt"` or a list of token indices and
    `{"span", "occurrence"}` objects (the API's JSON form)."""
    t = text.strip()
    if t.lower() in ("", "all", "all_prompt"):
        return "all_prompt"
    out: list[int | dict] = []
    for part in _parts(t, field_name):
        if part.lower().startswith("span:"):
            out.append(parse_span(part[5:], field_name))
        else:
            out.extend(_int_or_range(part, field_name, spans=True))
    return out


def format_layers(layers: list[int] | None) -> str:
    """Selector text for a layer list (runs of consecutive layers as `A-B`)."""
    if layers is None:
        return "all"
    return _runs(sorted(dict.fromkeys(layers)))


def format_positions(positions: str | list) -> str:
    """Selector text for the JSON form of positions."""
    if isinstance(positions, str):
        return "all" if positions == "all_prompt" else positions
    ints = [p for p in positions if isinstance(p, int)]
    spans = [p for p in positions if not isinstance(p, int)]
    parts = [_runs(ints)] if ints else []
    for s in spans:
        occ = s.get("occurrence", 0)
        parts.append(f"span:{s['span']}" + (f"#{occ}" if occ else ""))
    return ",".join(parts)


def _runs(values: list[int]) -> str:
    out: list[str] = []
    i = 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1] == values[j] + 1:
            j += 1
        out.append(str(values[i]) if j == i else f"{values[i]}-{values[j]}")
        i = j + 1
    return ",".join(out)

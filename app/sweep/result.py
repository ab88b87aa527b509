"""`SweepResult`: one patch sweep as plain data (numpy grids per hook + everything needed to
label, interpret and regenerate it). Built from the server's `summary` (the non-streaming
response body of `POST /v1/patch_sweep`, or the last `summary` event of its SSE stream), or
incrementally from the stream's events (`SweepResult.from_events`, `SweepResult.apply_event`).

Wire contract (the summary object; fork-compatible fields first)
-----------------------------------------------------------------
Fields of the reference fork's `PatchSweepResponse` (same names and meaning):

* `layers: list[int]`, `positions: list[int]` — the axes; `grid[i][j]` is `layers[i]` x
  `positions[j]` (positions are token indices of the corrupt `prompt`).
* `hook: str`, `grid: list[list[float|None]]`, `argmax` — the first hook's grid
  (`argmax = {"layer", "position", "value"}` = max value, or None).
* `hook_grids: [{"hook", "grid", "argmax"}] | None` — every hook (multi-hook sweeps; None for a
  single hook, as in the fork).
* `metric: str` — the unit of the grid values (`logprob`, `logit_diff`, `prob`, `recovered`).
* `clean`, `corrupt: float | None` — baseline values of the *basis* metric (`logprob`,
  `logit_diff` or `prob`; for `recovered` the basis named by `recovered_basis`).
* `skipped: list[dict]` — `{"position", "reason"}` for unaligned positions (not run), and
  `{"hook", "layer", "position", "reason"}` for voided cells (value null).
* `alignment: {"n_clean", "n_corrupt", "prefix_len", "suffix_len", "unaligned_positions",
  "position_map"} | None` — `position_map` maps corrupt position (as str) -> clean position.
* `noise_floor: float | None` — in the metric's units.
* `auto_captured: bool`, `captured_source_run: str | None`.

causalboard extensions (old clients ignore them):

* `sweep_id`, `model`, `prompt`, `clean_prompt`, `prompt_token_ids`, `token_strings` (display
  string of each corrupt-prompt token), `clean_token_ids`, `clean_token_strings`.
* `hooks: list[str]`; `metric_requested` (differs from `metric` only when `recovered` was asked
  for but is undefined — see `notes`); `recovered_basis`.
* `answer_token_id`, `answer_token`, `foil_token_id`, `foil_token`, `alpha`.
* `source: {"kind": "run" | "zeros" | "vector" | "inline" | "mean", "run_id"?, "name"?}`.
* `noise: {"positions", "scale", "seed", "samples"} | None` — noise corruption of the prompt.
* `noise_floor_detail: {"solo", "in_batch": [...], "units"}`; `within_noise: [{"hook", "layer",
  "position"}]` — cells whose effect (|value - corrupt| in metric units; |value| for
  `recovered`) is within the noise floor.
* `subject_positions: list[int]` — positions of `subject` / noise span, for figure marks.
* `checksum: {"consistent": bool, ...}` — cross-rank determinism of the engine's interventions.
* `cells_total`, `cells_done`, `cells_voided`, `elapsed_s`, `cancelled: bool`, `notes: [str]`,
  `versions: {name: version}`.

Stream events (each a JSON object with `type`; unknown types must be ignored): `start`
(axes, tokens, alignment, cells_total), `skip` (an unaligned position), `cell` ({hook, layer,
position, value} or a voided cell re-sent with `value: null` and `error`), `progress`,
`noise_floor`, `checksum`, `warning`, `error`, `summary` (the object above); then `[DONE]`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import numpy as np

#: summary keys that hold per-hook grids (rebuilt from `grids` when serializing)
_GRID_KEYS = ("grid", "hook_grids", "argmax")


@dataclass
class SweepResult:
    """A sweep: `grids[hook]` is a float array (layers x positions), NaN where no value
    (pending, skipped or voided). `meta` keeps every other summary field verbatim."""

    layers: list[int]
    positions: list[int]
    hooks: list[str]
    metric: str
    grids: dict[str, np.ndarray]
    meta: dict[str, Any] = field(default_factory=dict)

    # ---- construction ------------------------------------------------------------------------
    @classmethod
    def from_summary(cls, summary: dict) -> "SweepResult":
        """From the non-streaming response / the `summary` event."""
        layers = [int(x) for x in summary["layers"]]
        positions = [int(x) for x in summary["positions"]]
        if summary.get("hook_grids"):
            pairs = [(g["hook"], g["grid"]) for g in summary["hook_grids"]]
        else:
            pairs = [(summary["hook"], summary["grid"])]
        grids = {h: _to_array(g, len(layers), len(positions)) for h, g in pairs}
        meta = {k: v for k, v in summary.items() if k not in _GRID_KEYS and k not in ("layers", "positions", "metric")}
        meta.setdefault("hooks", [h for h, _ in pairs])
        return cls(layers, positions, [h for h, _ in pairs], summary.get("metric", "logprob"), grids, meta)

    @classmethod
    def from_start(cls, start: dict) -> "SweepResult":
        """An empty (all-NaN) result with the axes of a `start` event; fill it with `apply_event`."""
        layers = [int(x) for x in start["layers"]]
        positions = [int(x) for x in start["positions"]]
        hooks = list(start.get("hooks") or [start["hook"]])
        grids = {h: np.full((len(layers), len(positions)), np.nan) for h in hooks}
        meta = {k: v for k, v in start.items() if k not in ("type", "layers", "positions", "metric")}
        meta["hooks"] = hooks
        meta.setdefault("skipped", [])
        return cls(layers, positions, hooks, start.get("metric", "logprob"), grids, meta)

    @classmethod
    def from_events(cls, events: Iterable[dict]) -> "SweepResult":
        """Fold a stream's events (dicts, `[DONE]` already removed). Raises ValueError when the
        stream has no `start` or `summary` event."""
        result: SweepResult | None = None
        for ev in events:
            if ev.get("type") == "summary":
                return cls.from_summary(ev)
            if ev.get("type") == "start":
                result = cls.from_start(ev)
            elif result is not None:
                result.apply_event(ev)
        if result is None:
            raise ValueError("the stream had no 'start' or 'summary' event")
        return result

    def apply_event(self, ev: dict) -> None:
        """Apply one stream event in place (cells, skips, noise floor, checksum, progress);
        unknown event types are ignored."""
        kind = ev.get("type")
        if kind == "cell":
            hook = ev.get("hook") or self.hooks[0]
            i, j = self.layers.index(int(ev["layer"])), self.positions.index(int(ev["position"]))
            value = ev.get("value")
            self.grids[hook][i, j] = np.nan if value is None else float(value)
            if value is None and ev.get("error"):
                self.meta.setdefault("skipped", []).append(
                    {"hook": hook, "layer": int(ev["layer"]), "position": int(ev["position"]), "reason": ev["error"]})
        elif kind == "skip":
            self.meta.setdefault("skipped", []).append({"position": ev["position"], "reason": ev["reason"]})
        elif kind == "noise_floor":
            self.meta["noise_floor"] = ev.get("value")
        elif kind in ("checksum", "progress"):
            self.meta[kind] = {k: v for k, v in ev.items() if k != "type"}

    # ---- access --------------------------------------------------------------------------------
    @property
    def hook(self) -> str:
        return self.hooks[0]

    @property
    def noise_floor(self) -> float | None:
        return self.meta.get("noise_floor")

    @property
    def skipped(self) -> list[dict]:
        return list(self.meta.get("skipped", []))

    @property
    def token_strings(self) -> list[str]:
        """Display string of each swept position's token (falls back to the position number)."""
        toks = self.meta.get("token_strings")
        return [toks[p] if toks and 0 <= p < len(toks) else str(p) for p in self.positions]

    def to_numpy(self, hook: str | None = None) -> np.ndarray:
        """The grid (layers x positions) of `hook` (default: the first), NaN where no value."""
        return self.grids[hook or self.hooks[0]].copy()

    def top(self, k: int = 5, hook: str | None = None) -> list[dict]:
        """The k largest cells over `hook` (default: every hook):
        `[{"hook", "layer", "position", "token", "value"}]`, largest first."""
        toks = self.token_strings
        cells = []
        for h in ([hook] if hook else self.hooks):
            g = self.grids[h]
            for i, layer in enumerate(self.layers):
                for j, pos in enumerate(self.positions):
                    if not math.isnan(g[i, j]):
                        cells.append({"hook": h, "layer": layer, "position": pos, "token": toks[j], "value": float(g[i, j])})
        cells.sort(key=lambda c: -c["value"])
        return cells[:k]

    def heatmap(self, hook: str | None = None, ax: Any = None, **kwargs: Any) -> Any:
        """Draw one hook's grid with matplotlib (see `app.figures.export.plot_sweep`); returns the figure."""
        from app.figures.export import plot_sweep

        return plot_sweep(self, hook=hook, ax=ax, **kwargs)

    # ---- serialization -------------------------------------------------------------------------
    def to_summary(self) -> dict:
        """The summary object (wire contract above); `from_summary(to_summary())` round-trips."""
        out = dict(self.meta)
        out.update(layers=list(self.layers), positions=list(self.positions), metric=self.metric, hooks=list(self.hooks))
        hook_grids = []
        for h in self.hooks:
            grid = _to_lists(self.grids[h])
            hook_grids.append({"hook": h, "grid": grid, "argmax": argmax_cell(grid, self.layers, self.positions)})
        out.update(hook=self.hooks[0], grid=hook_grids[0]["grid"], argmax=hook_grids[0]["argmax"],
                   hook_grids=hook_grids if len(self.hooks) > 1 else None)
        return out

    def save(self, path: str | Path) -> Path:
        """Write `.json` (the summary) or `.npz` (grids `grid_<hook>`, axes, and the summary as
        JSON under `summary_json`)."""
        path = Path(path)
        if path.suffix == ".npz":
            arrays = {f"grid_{h}": self.grids[h] for h in self.hooks}
            np.savez(path, layers=np.array(self.layers), positions=np.array(self.positions),
                     summary_json=np.array(json.dumps(self.to_summary())), **arrays)
        else:
            path.write_text(json.dumps(self.to_summary(), indent=1))
        return path

    @classmethod
    def load(cls, path: str | Path) -> "SweepResult":
        path = Path(path)
        if path.suffix == ".npz":
            with np.load(path) as z:
                return cls.from_summary(json.loads(str(z["summary_json"])))
        return cls.from_summary(json.loads(path.read_text()))


def _to_array(grid: list[list[float | None]], n_layers: int, n_positions: int) -> np.ndarray:
    arr = np.full((n_layers, n_positions), np.nan)
    for i, row in enumerate(grid):
        for j, v in enumerate(row):
            if v is not None:
                arr[i, j] = float(v)
    return arr


def _to_lists(arr: np.ndarray) -> list[list[float | None]]:
    return [[None if math.isnan(v) else float(v) for v in row] for row in arr.tolist()]


def argmax_cell(grid: list[list[float | None]], layers: list[int], positions: list[int]) -> dict | None:
    """`{"layer", "position", "value"}` of the largest value (the first one on ties), or None
    when the grid has no value (the fork's `argmax`)."""
    best = None
    for i, row in enumerate(grid):
        for j, v in enumerate(row):
            if v is not None and (best is None or v > best["value"]):
                best = {"layer": layers[i], "position": positions[j], "value": v}
    return best

"""`SweepResult`: one patch sweep as plain data — numpy grids per hook, plus every other summary
field (`meta`) needed to label, interpret and regenerate it. Built from a summary
(`SweepResult.from_summary`: the JSON answer of `POST /v1/patch_sweep`, its last stream event, a
saved file), or from a stream's events by the sweep's one event reader (`app/sweep/fold.py`:
`SweepFold`, `result_from_events`), which also fills a result cell by cell while a sweep runs.
In a notebook a result displays as its summary and heatmaps (`app/figures/display.py`).

The summary's fields, their types and meanings are declared in `app/sweep/schema.py`
(`SweepSummary`). `meta` keeps them as JSON data (a dict), verbatim: a file saved by another
version round-trips whatever it holds. Figures of a result: `app.figures.export.plot_sweep`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from app.sweep.schema import SweepSummary

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
    def from_summary(cls, summary: SweepSummary | Mapping[str, Any]) -> "SweepResult":
        """From a summary: the model, or its JSON form (a `summary` event's `type` is ignored)."""
        if isinstance(summary, SweepSummary):
            summary = summary.model_dump(mode="json", exclude={"type"})
        layers = [int(x) for x in summary["layers"]]
        run_positions = [int(x) for x in summary["positions"]]
        # the column axis: every swept position (unaligned ones included, as NaN columns) when the
        # summary lists them (`swept_positions`), else the wire's `positions`
        positions = [int(x) for x in summary.get("swept_positions") or run_positions]
        if summary.get("hook_grids"):
            pairs = [(g["hook"], g["grid"]) for g in summary["hook_grids"]]
        else:
            pairs = [(summary["hook"], summary["grid"])]
        cols = [positions.index(p) for p in run_positions] if positions != run_positions else None
        grids = {h: _to_array(g, len(layers), len(positions), cols) for h, g in pairs}
        meta = {k: v for k, v in summary.items() if k not in _GRID_KEYS and k not in ("type", "layers", "positions", "metric")}
        meta["swept_positions"] = positions
        meta.setdefault("hooks", [h for h, _ in pairs])
        return cls(layers, positions, [h for h, _ in pairs], summary.get("metric", "logprob"), grids, meta)

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

    # ---- display (notebooks: the heatmaps, not the grids; app/figures/display.py) ----------------
    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, str]:
        from app.figures.display import sweep_mimebundle

        return sweep_mimebundle(self, include, exclude)

    def _repr_html_(self) -> str:
        from app.figures.display import sweep_html

        return sweep_html(self)

    # ---- serialization -------------------------------------------------------------------------
    def to_summary(self) -> dict:
        """The summary as JSON data (`SweepSummary`'s fields); `from_summary(to_summary())` round-trips."""
        out = dict(self.meta)
        out.update(layers=list(self.layers), positions=list(self.positions), swept_positions=list(self.positions),
                   metric=self.metric, hooks=list(self.hooks))
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


def _to_array(grid: list[list[float | None]], n_layers: int, n_positions: int, cols: list[int] | None = None) -> np.ndarray:
    """The grid as a float array; `cols[j]` is the array column of the grid's column j (None:
    the same)."""
    arr = np.full((n_layers, n_positions), np.nan)
    for i, row in enumerate(grid):
        for j, v in enumerate(row):
            if v is not None:
                arr[i, j if cols is None else cols[j]] = float(v)
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

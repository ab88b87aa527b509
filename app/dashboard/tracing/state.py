"""Pure state of one live patch sweep, folded from its SSE events (no Panel, no Bokeh, no I/O).

`SweepState.apply(event)` takes the decoded events of `POST /v1/patch_sweep` with
`stream: true` (see the wire contract in `app/sweep/result.py`) in arrival order. It keeps

* the grids (a `SweepResult`, NaN where no value) and one status per cell
  (`CellStatus`: pending, done, noise, skipped, voided) with the reason for skipped/voided cells;
* progress (`cells_done` counts each cell once: a voided cell that arrives as a second event for
  an already-filled cell blanks it without being counted again), cells/s, elapsed time;
* the noise floor, the alignment, the checksum, baselines, warnings and errors;
* which cells changed since the view last asked (`take_dirty`), so a view can send one
  incremental update per refresh.

The `summary` event is authoritative: it replaces the grids and statuses with the server's final
view (`within_noise`, `skipped`). Unknown event types are ignored; a `cell` for a hook, layer or
position outside the axes is ignored too (it cannot be drawn) and counted in `ignored_events`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable

import numpy as np

from app.sweep.result import SweepResult


class CellStatus(Enum):
    """How one (hook, layer, position) cell looks on the heatmap. (A plain Enum on purpose:
    numpy turns str-enums into text inside object arrays, which breaks `grid == status`.)"""

    PENDING = "pending"  # not computed yet (or never: the sweep was cancelled)
    DONE = "done"  # has a value outside the noise floor
    NOISE = "noise"  # has a value whose effect is within the noise floor
    SKIPPED = "skipped"  # position not run: clean/corrupt tokens are unaligned there
    VOIDED = "voided"  # was run but its patch failed to resolve; value withdrawn


def status_grid(shape: tuple[int, int]) -> np.ndarray:
    """An object array (layers x positions) of `CellStatus.PENDING`."""
    grid = np.empty(shape, dtype=object)
    grid.fill(CellStatus.PENDING)
    return grid


#: shortest local time span a cells/s figure is computed over
MIN_RATE_SPAN_S = 0.25

#: a changed cell: (hook, layer index, position index)
CellKey = tuple[str, int, int]


@dataclass
class SweepState:
    """Everything a view shows about one sweep. Create it empty and `apply` events; `result`
    is None until the `start` (or `summary`) event arrives."""

    clock: Callable[[], float] = time.monotonic
    result: SweepResult | None = None
    status: dict[str, np.ndarray] = field(default_factory=dict)  # hook -> (layers x positions) CellStatus values
    reasons: dict[CellKey, str] = field(default_factory=dict)  # skipped/voided cell -> reason
    skipped_positions: dict[int, str] = field(default_factory=dict)  # unaligned position -> reason
    cells_done: int = 0
    cells_voided: int = 0
    server_cells_total: int | None = None
    noise_floor: float | None = None
    corrupt: float | None = None
    clean: float | None = None
    checksum: dict | None = None
    alignment: dict | None = None
    warnings: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    finished: bool = False  # a summary arrived
    cancelled: bool = False
    ignored_events: int = 0
    started_at: float | None = None
    last_cell_at: float | None = None
    finished_at: float | None = None
    server_elapsed_s: float | None = None
    server_cells_per_s: float | None = None
    axes_changed: bool = False  # a new `start`/`summary` changed the axes: rebuild figures
    _dirty: set[CellKey] = field(default_factory=set)
    _resolved: set[CellKey] = field(default_factory=set)  # cells counted in cells_done

    # ---- folding ---------------------------------------------------------------------------------
    def apply(self, ev: dict) -> None:
        """Fold one event in; unknown types are ignored."""
        kind = ev.get("type") if isinstance(ev, dict) else None
        handler = {
            "start": self._on_start,
            "cell": self._on_cell,
            "skip": self._on_skip,
            "noise_floor": self._on_noise_floor,
            "checksum": self._on_checksum,
            "progress": self._on_progress,
            "warning": self._on_warning,
            "error": self._on_error,
            "summary": self._on_summary,
        }.get(kind)
        if handler is None:
            self.ignored_events += 1
            return
        handler(ev)

    def _on_start(self, ev: dict) -> None:
        self.result = SweepResult.from_start(ev)
        self.started_at = self.clock()
        self.server_cells_total = _int_or_none(ev.get("cells_total"))
        self.alignment = ev.get("alignment")
        self.corrupt = _float_or_none(ev.get("corrupt"))
        self.clean = _float_or_none(ev.get("clean"))
        if ev.get("noise_floor") is not None:
            self.noise_floor = float(ev["noise_floor"])
        shape = (len(self.result.layers), len(self.result.positions))
        self.status = {h: status_grid(shape) for h in self.result.hooks}
        self.reasons.clear()
        self.skipped_positions.clear()
        self._resolved.clear()
        self.cells_done = self.cells_voided = 0
        self.axes_changed = True
        self._mark_all_dirty()
        # a start event may already list unaligned positions
        for p in (self.alignment or {}).get("unaligned_positions") or []:
            self._skip_position(int(p), "unaligned: clean/corrupt token spans differ here")

    def _on_cell(self, ev: dict) -> None:
        key = self._key(ev)
        if key is None:
            self.ignored_events += 1
            return
        hook, i, j = key
        value = ev.get("value")
        now = self.clock()
        self.last_cell_at = now
        if key not in self._resolved:
            self._resolved.add(key)
            self.cells_done += 1
        if value is None:
            if self.status[hook][i, j] != CellStatus.VOIDED:
                self.cells_voided += 1
            self.result.grids[hook][i, j] = np.nan
            self.status[hook][i, j] = CellStatus.VOIDED
            self.reasons[key] = str(ev.get("error") or "voided")
        else:
            self.result.grids[hook][i, j] = float(value)
            self.status[hook][i, j] = self._value_status(float(value))
            self.reasons.pop(key, None)
        self._dirty.add(key)

    def _on_skip(self, ev: dict) -> None:
        if self.result is None or ev.get("position") is None:
            self.ignored_events += 1
            return
        self._skip_position(int(ev["position"]), str(ev.get("reason") or "skipped"))

    def _on_noise_floor(self, ev: dict) -> None:
        self.noise_floor = _float_or_none(ev.get("value", ev.get("noise_floor")))
        if ev.get("corrupt") is not None:
            self.corrupt = float(ev["corrupt"])
        self._reflag_noise()

    def _on_checksum(self, ev: dict) -> None:
        self.checksum = {k: v for k, v in ev.items() if k != "type"}

    def _on_progress(self, ev: dict) -> None:
        total = ev.get("cells_total", ev.get("total"))
        if total is not None:
            self.server_cells_total = int(total)
        if ev.get("elapsed_s") is not None:
            self.server_elapsed_s = float(ev["elapsed_s"])
        if ev.get("cells_per_s") is not None:
            self.server_cells_per_s = float(ev["cells_per_s"])

    def _on_warning(self, ev: dict) -> None:
        self.warnings.append(str(ev.get("message") or ev.get("warning") or ev))

    def _on_error(self, ev: dict) -> None:
        self.errors.append(str(ev.get("error") or ev.get("message") or ev))

    def _on_summary(self, ev: dict) -> None:
        """Adopt the server's final result: grids, skipped/voided cells, noise flags."""
        old_axes = (self.result.layers, self.result.positions, self.result.hooks) if self.result else None
        self.result = SweepResult.from_summary(ev)
        r = self.result
        if old_axes != (r.layers, r.positions, r.hooks):
            self.axes_changed = True
        self.finished = True
        self.finished_at = self.clock()
        if self.started_at is None:
            self.started_at = self.finished_at
        self.cancelled = bool(ev.get("cancelled"))
        self.noise_floor = _float_or_none(ev.get("noise_floor"))
        self.clean, self.corrupt = _float_or_none(ev.get("clean")), _float_or_none(ev.get("corrupt"))
        self.alignment = ev.get("alignment") or self.alignment
        if ev.get("checksum") is not None:
            self.checksum = ev["checksum"]
        self.server_cells_total = _int_or_none(ev.get("cells_total")) or self.server_cells_total
        self.server_elapsed_s = _float_or_none(ev.get("elapsed_s"))
        within = {(c.get("hook") or r.hooks[0], int(c["layer"]), int(c["position"])) for c in ev.get("within_noise") or []}
        shape = (len(r.layers), len(r.positions))
        self.status = {h: status_grid(shape) for h in r.hooks}
        self.reasons = {}
        self.skipped_positions = {}
        for s in ev.get("skipped") or []:
            if "layer" in s and "hook" in s:
                key = self._key(s)
                if key is not None:
                    self.status[key[0]][key[1], key[2]] = CellStatus.VOIDED
                    self.reasons[key] = str(s.get("reason") or "voided")
            elif s.get("position") is not None:
                self._skip_position(int(s["position"]), str(s.get("reason") or "skipped"))
        resolved = set()
        for h in r.hooks:
            g = r.grids[h]
            for i, layer in enumerate(r.layers):
                for j, pos in enumerate(r.positions):
                    if self.status[h][i, j] == CellStatus.VOIDED:
                        resolved.add((h, i, j))
                    elif not math.isnan(g[i, j]):
                        resolved.add((h, i, j))
                        self.status[h][i, j] = CellStatus.NOISE if (h, layer, pos) in within else CellStatus.DONE
        self._resolved = resolved
        self.cells_done = _int_or_none(ev.get("cells_done")) or len(resolved)
        self.cells_voided = _int_or_none(ev.get("cells_voided")) or sum(
            1 for h in r.hooks for s in self.status[h].ravel() if s == CellStatus.VOIDED)
        self.warnings.extend(str(n) for n in ev.get("notes") or [] if str(n) not in self.warnings)
        self._mark_all_dirty()

    # ---- helpers ---------------------------------------------------------------------------------
    def _key(self, ev: dict) -> CellKey | None:
        r = self.result
        if r is None:
            return None
        hook = ev.get("hook") or r.hooks[0]
        try:
            i, j = r.layers.index(int(ev["layer"])), r.positions.index(int(ev["position"]))
        except (KeyError, TypeError, ValueError):
            return None
        return (hook, i, j) if hook in self.status else None

    def _skip_position(self, position: int, reason: str) -> None:
        self.skipped_positions[position] = reason
        if self.result is None or position not in self.result.positions:
            return
        j = self.result.positions.index(position)
        for h in self.result.hooks:
            for i in range(len(self.result.layers)):
                if self.status[h][i, j] in (CellStatus.PENDING, CellStatus.SKIPPED):
                    self.status[h][i, j] = CellStatus.SKIPPED
                    self.reasons[(h, i, j)] = reason
                    self._dirty.add((h, i, j))

    def effect(self, value: float) -> float | None:
        """The size of a cell's effect in the metric's units, as the server defines it for
        `within_noise`: |value| for `recovered`, |value - corrupt| otherwise (None while the
        corrupt baseline is unknown)."""
        if self.result is not None and self.result.metric == "recovered":
            return abs(value)
        return None if self.corrupt is None else abs(value - self.corrupt)

    def _value_status(self, value: float) -> CellStatus:
        if self.noise_floor is None:
            return CellStatus.DONE
        eff = self.effect(value)
        return CellStatus.NOISE if eff is not None and eff <= self.noise_floor else CellStatus.DONE

    def _reflag_noise(self) -> None:
        if self.result is None:
            return
        for h in self.result.hooks:
            st, g = self.status[h], self.result.grids[h]
            for i in range(st.shape[0]):
                for j in range(st.shape[1]):
                    if st[i, j] in (CellStatus.DONE, CellStatus.NOISE):
                        new = self._value_status(float(g[i, j]))
                        if new != st[i, j]:
                            st[i, j] = new
                            self._dirty.add((h, i, j))

    def _mark_all_dirty(self) -> None:
        if self.result is None:
            return
        self._dirty |= {(h, i, j) for h in self.result.hooks
                        for i in range(len(self.result.layers)) for j in range(len(self.result.positions))}

    # ---- reading ---------------------------------------------------------------------------------
    def take_dirty(self) -> set[CellKey]:
        """The cells changed since the last call (and forget them)."""
        dirty, self._dirty = self._dirty, set()
        return dirty

    @property
    def cells_total(self) -> int:
        """Cells the sweep will run: the server's count when it sent one, else every
        hook x layer x aligned position."""
        if self.server_cells_total is not None:
            return self.server_cells_total
        if self.result is None:
            return 0
        aligned = [p for p in self.result.positions if p not in self.skipped_positions]
        return len(self.result.hooks) * len(self.result.layers) * len(aligned)

    @property
    def elapsed_s(self) -> float:
        """Seconds the sweep has run: the server's count once the summary gave it, else since
        the `start` event arrived here."""
        if self.finished and self.server_elapsed_s is not None:
            return self.server_elapsed_s
        if self.started_at is None:
            return 0.0
        end = self.finished_at if self.finished_at is not None else self.clock()
        return max(0.0, end - self.started_at)

    @property
    def cells_per_s(self) -> float | None:
        """Cells per second: done / the server's elapsed time once finished, else the server's
        latest `progress` rate, else measured here from `start` to the last cell (only over at
        least `MIN_RATE_SPAN_S`: events arrive in bursts). None when unknown."""
        if self.finished and self.server_elapsed_s:
            return self.cells_done / self.server_elapsed_s
        if self.server_cells_per_s is not None:
            return self.server_cells_per_s
        if self.started_at is None or self.last_cell_at is None or self.cells_done == 0:
            return None
        span = self.last_cell_at - self.started_at
        return self.cells_done / span if span >= MIN_RATE_SPAN_S else None

    @property
    def fraction_done(self) -> float:
        total = self.cells_total
        return min(1.0, self.cells_done / total) if total else (1.0 if self.finished else 0.0)

    def count(self, status: CellStatus) -> int:
        return sum(int(np.count_nonzero(st == status)) for st in self.status.values())

    def cell(self, hook: str, i: int, j: int) -> tuple[float, CellStatus, str]:
        """(value or NaN, status, reason) of one cell."""
        return float(self.result.grids[hook][i, j]), self.status[hook][i, j], self.reasons.get((hook, i, j), "")

    @property
    def source_run(self) -> str | None:
        """The kept clean run to reuse for zoom sweeps (None when the server did not keep one)."""
        return self.result.meta.get("captured_source_run") if self.result else None

    @property
    def sweep_id(self) -> str | None:
        return self.result.meta.get("sweep_id") if self.result else None

    def checksum_text(self) -> str:
        """'pending', 'consistent (N ranks)', 'mismatch (tp0/pp0 ≠ tp1/pp0)' or
        'unavailable (<error>)' — from the latest `checksum` event or the summary."""
        c = self.checksum
        if not c:
            return "pending"
        if c.get("consistent") is True:
            ranks = c.get("ranks")
            return f"consistent ({ranks} rank{'s' if ranks != 1 else ''})" if isinstance(ranks, int) else "consistent"
        if c.get("consistent") is False:
            groups = c.get("mismatches") or c.get("checksums") or {}
            names: list[str] = []
            for key, val in groups.items():
                names.extend(val.keys() if isinstance(val, dict) else [key])
            return f"mismatch ({' ≠ '.join(names)})" if names else "mismatch"
        return f"unavailable ({c['error']})" if c.get("error") else "unknown"


def _float_or_none(v: Any) -> float | None:
    return None if v is None else float(v)


def _int_or_none(v: Any) -> int | None:
    return None if v is None else int(v)


__all__ = ["CellStatus", "CellKey", "SweepState", "status_grid"]

"""`SweepFold`: the one reader of a patch sweep's event stream (no I/O, no plotting, no Panel).

Every consumer of a sweep's events folds them here, in arrival order: `result_from_events`, the
Python client's streamed `patch_sweep` (result, progress bar, failure) and the dashboard's live
view. `fold.apply(event)` takes one decoded `data:` object (or a typed event), parses it with
`app.sweep.schema.parse_event` — a malformed event raises `SweepEventError` naming the field and
leaves the fold unchanged; an unknown event type is ignored — and keeps

* `result`: the `SweepResult` being built — axes from `start`, values from `cell`s, unaligned
  positions and voided cells in `meta["skipped"]`, `meta["noise_floor"]`, `meta["checksum"]`;
  the `summary` event replaces it with the server's final result;
* one `CellStatus` per cell (pending, done, noise, skipped, voided) and the reason of each
  skipped or voided cell;
* progress: `cells_done` counts each cell once (a voided cell that arrives as a second event for
  an already-filled cell blanks it without being counted again), the server's total and rate,
  elapsed time;
* the noise floor (cells whose effect is within it are `NOISE`), baselines, alignment, checksum,
  warnings, errors and the summary (`summary`, `finished`, `cancelled`);
* which cells changed since the last `take_dirty()`, and whether the axes changed
  (`axes_changed`), so a view can send incremental updates.

The `summary` event is authoritative: grids and statuses become the server's final view
(`within_noise`, `skipped`; see `result_statuses`). A `cell` for a hook, layer or position outside
the axes, or a `cell`/`skip` before the `start` event, cannot be placed: it is ignored and counted
in `ignored_events`, as are unknown event types.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import numpy as np

from app.sweep.alignment import UNALIGNED_REASON
from app.sweep.result import SweepResult
from app.sweep.schema import (CellEvent, ChecksumEvent, ErrorEvent, NoiseFloorEvent, ProgressEvent, SkipEvent, StartEvent,
                              SummaryEvent, SweepAlignment, SweepChecksum, SweepEventModel, VoidedCell, WarningEvent,
                              parse_event)


class CellStatus(Enum):
    """What is known about one (hook, layer, position) cell. (A plain Enum on purpose: numpy turns
    str-enums into text inside object arrays, which breaks `grid == status`.)"""

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


def result_statuses(result: SweepResult, hook: str) -> np.ndarray:
    """The status of every cell of `hook` (layers x positions object array) that a result's data
    imply: DONE where there is a value, NOISE where that cell is listed in `meta["within_noise"]`;
    SKIPPED where there is none and `meta["skipped"]` lists the position without a layer (an
    unaligned position), VOIDED where it lists the cell; PENDING otherwise. Entries without a
    hook apply to every hook."""
    grid = result.grids[hook]
    status = status_grid(grid.shape)
    status[np.isfinite(grid)] = CellStatus.DONE
    rows = {layer: i for i, layer in enumerate(result.layers)}
    cols = {pos: j for j, pos in enumerate(result.positions)}
    for entry in result.meta.get("skipped") or []:
        j = cols.get(_int_or_none(entry.get("position")))
        if j is None:
            continue
        if entry.get("layer") is None:  # an unaligned position: the whole column was not run
            column = status[:, j]
            column[column == CellStatus.PENDING] = CellStatus.SKIPPED
        elif entry.get("hook") in (None, hook):
            i = rows.get(_int_or_none(entry.get("layer")))
            if i is not None and status[i, j] == CellStatus.PENDING:
                status[i, j] = CellStatus.VOIDED
    for entry in result.meta.get("within_noise") or []:
        if entry.get("hook") not in (None, hook):
            continue
        i, j = rows.get(_int_or_none(entry.get("layer"))), cols.get(_int_or_none(entry.get("position")))
        if i is not None and j is not None and status[i, j] == CellStatus.DONE:
            status[i, j] = CellStatus.NOISE
    return status


#: shortest local time span a cells/s figure is computed over
MIN_RATE_SPAN_S = 0.25

#: a changed cell: (hook, layer index, position index)
CellKey = tuple[str, int, int]


@dataclass
class SweepFold:
    """Everything the events of one sweep say. Create it empty and `apply` events; `result` is
    None until the `start` (or `summary`) event arrives."""

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
    checksum: SweepChecksum | None = None
    alignment: SweepAlignment | None = None
    summary: SummaryEvent | None = None  # the server's summary, once it arrived
    warnings: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # `error` events: the sweep failed
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
    _voided_entries: dict[CellKey, dict] = field(default_factory=dict)  # voided cell -> its entry in result.meta["skipped"]

    # ---- folding ---------------------------------------------------------------------------------
    def apply(self, event: Mapping[str, Any] | SweepEventModel) -> SweepEventModel | None:
        """Fold one event in; returns it typed (None for an unknown type, which is ignored).
        Raises `SweepEventError` for a malformed event, before changing anything."""
        ev = parse_event(event)
        if ev is None:
            self.ignored_events += 1
            return None
        if isinstance(ev, StartEvent):
            self._on_start(ev)
        elif isinstance(ev, CellEvent):
            self._on_cell(ev)
        elif isinstance(ev, SkipEvent):
            self._on_skip(ev)
        elif isinstance(ev, NoiseFloorEvent):
            self._on_noise_floor(ev)
        elif isinstance(ev, ChecksumEvent):
            self._on_checksum(ev)
        elif isinstance(ev, ProgressEvent):
            self._on_progress(ev)
        elif isinstance(ev, WarningEvent):
            self.warnings.append(ev.message)
        elif isinstance(ev, ErrorEvent):
            self.errors.append(ev.error)
        elif isinstance(ev, SummaryEvent):
            self._on_summary(ev)
        return ev

    def _on_start(self, ev: StartEvent) -> None:
        hooks = list(ev.hooks or [ev.hook])
        meta = ev.model_dump(mode="json", exclude={"type", "layers", "positions", "metric"})
        meta.update(hooks=hooks, skipped=[])
        # causalboard's axis keeps unaligned positions (NaN columns): `swept_positions` when sent
        positions = list(ev.swept_positions or ev.positions)
        meta["swept_positions"] = positions
        shape = (len(ev.layers), len(positions))
        self.result = SweepResult(list(ev.layers), positions, hooks, ev.metric,
                                  {h: np.full(shape, np.nan) for h in hooks}, meta)
        self.started_at = self.clock()
        self.server_cells_total = ev.cells_total
        self.alignment = ev.alignment
        self.corrupt, self.clean = ev.corrupt, ev.clean
        self.status = {h: status_grid(shape) for h in hooks}
        self.reasons.clear()
        self.skipped_positions.clear()
        self._resolved.clear()
        self._voided_entries.clear()
        self.cells_done = self.cells_voided = 0
        self.axes_changed = True
        self._mark_all_dirty()
        # the start event already lists the unaligned positions (a `skip` event follows for each swept one)
        for p in ev.alignment.unaligned_positions if ev.alignment else ():
            self._skip_position(p, UNALIGNED_REASON)

    def _on_cell(self, ev: CellEvent) -> None:
        key = self._key(ev)
        if key is None:
            self.ignored_events += 1
            return
        hook, i, j = key
        self.last_cell_at = self.clock()
        if key not in self._resolved:
            self._resolved.add(key)
            self.cells_done += 1
        if ev.value is None:
            reason = ev.error or "voided"
            if self.status[hook][i, j] != CellStatus.VOIDED:
                self.cells_voided += 1
            self.result.grids[hook][i, j] = np.nan
            self.status[hook][i, j] = CellStatus.VOIDED
            self.reasons[key] = reason
            self._record_voided(key, reason)
        else:
            self.result.grids[hook][i, j] = ev.value
            self.status[hook][i, j] = self._value_status(ev.value)
            self.reasons.pop(key, None)
            self._record_voided(key, None)
        self._dirty.add(key)

    def _on_skip(self, ev: SkipEvent) -> None:
        if self.result is None:
            self.ignored_events += 1
            return
        self._skip_position(ev.position, ev.reason)

    def _on_noise_floor(self, ev: NoiseFloorEvent) -> None:
        self.noise_floor = ev.value
        if self.result is not None:
            self.result.meta["noise_floor"] = ev.value
        self._reflag_noise()

    def _on_checksum(self, ev: ChecksumEvent) -> None:
        self.checksum = ev
        if self.result is not None:
            self.result.meta["checksum"] = ev.model_dump(mode="json", exclude={"type"})

    def _on_progress(self, ev: ProgressEvent) -> None:
        self.server_cells_total = ev.total
        if ev.elapsed_s is not None:
            self.server_elapsed_s = ev.elapsed_s
        if ev.cells_per_s is not None:
            self.server_cells_per_s = ev.cells_per_s

    def _on_summary(self, ev: SummaryEvent) -> None:
        """Adopt the server's final result: grids, skipped/voided cells, noise flags."""
        old_axes = (self.result.layers, self.result.positions, self.result.hooks) if self.result else None
        self.summary = ev
        self.result = r = SweepResult.from_summary(ev)
        if old_axes != (r.layers, r.positions, r.hooks):
            self.axes_changed = True
        self.finished = True
        self.finished_at = self.clock()
        if self.started_at is None:
            self.started_at = self.finished_at
        self.cancelled = ev.cancelled
        self.noise_floor = ev.noise_floor
        self.clean, self.corrupt = ev.clean, ev.corrupt
        self.alignment = ev.alignment or self.alignment
        if ev.checksum is not None:
            self.checksum = ev.checksum
        self.server_cells_total = ev.cells_total or self.server_cells_total
        self.server_elapsed_s = ev.elapsed_s
        self.status = {h: result_statuses(r, h) for h in r.hooks}
        self.reasons, self.skipped_positions, self._voided_entries = {}, {}, {}
        for s in ev.skipped:
            if isinstance(s, VoidedCell):
                key = self._key(s)
                if key is not None and self.status[key[0]][key[1], key[2]] == CellStatus.VOIDED:
                    self.reasons[key] = s.reason
            else:
                self.skipped_positions[s.position] = s.reason
                if s.position in r.positions:
                    j = r.positions.index(s.position)
                    for h in r.hooks:
                        for i in range(len(r.layers)):
                            if self.status[h][i, j] == CellStatus.SKIPPED:
                                self.reasons[(h, i, j)] = s.reason
        resolved = {(h, i, j) for h in r.hooks for i in range(len(r.layers)) for j in range(len(r.positions))
                    if self.status[h][i, j] in (CellStatus.DONE, CellStatus.NOISE, CellStatus.VOIDED)}
        self._resolved = resolved
        self.cells_done = ev.cells_done or len(resolved)
        self.cells_voided = ev.cells_voided or self.count(CellStatus.VOIDED)
        self.warnings.extend(n for n in ev.notes if n not in self.warnings)
        self._mark_all_dirty()

    # ---- helpers ---------------------------------------------------------------------------------
    def _key(self, cell: CellEvent | VoidedCell) -> CellKey | None:
        """(hook, layer index, position index) of a cell, or None when it is not on the axes."""
        r = self.result
        if r is None:
            return None
        hook = cell.hook or r.hooks[0]
        if hook not in self.status or cell.layer not in r.layers or cell.position not in r.positions:
            return None
        return (hook, r.layers.index(cell.layer), r.positions.index(cell.position))

    def _skip_position(self, position: int, reason: str) -> None:
        self.skipped_positions[position] = reason
        r = self.result
        if r is None or position not in r.positions:
            return
        skipped = r.meta.setdefault("skipped", [])
        entry = {"position": position, "reason": reason}
        k = next((k for k, s in enumerate(skipped) if "layer" not in s and s.get("position") == position), None)
        if k is None:
            skipped.append(entry)
        else:
            skipped[k] = entry
        j = r.positions.index(position)
        for h in r.hooks:
            for i in range(len(r.layers)):
                if self.status[h][i, j] in (CellStatus.PENDING, CellStatus.SKIPPED):
                    self.status[h][i, j] = CellStatus.SKIPPED
                    self.reasons[(h, i, j)] = reason
                    self._dirty.add((h, i, j))

    def _record_voided(self, key: CellKey, reason: str | None) -> None:
        """Keep `result.meta["skipped"]` listing the voided cell `key` with `reason` (None: no
        longer voided)."""
        entry = self._voided_entries.get(key)
        if reason is None:
            if entry is not None:
                self.result.meta["skipped"].remove(self._voided_entries.pop(key))
        elif entry is not None:
            entry["reason"] = reason
        else:
            r = self.result
            entry = {"hook": key[0], "layer": r.layers[key[1]], "position": r.positions[key[2]], "reason": reason}
            r.meta.setdefault("skipped", []).append(entry)
            self._voided_entries[key] = entry

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
        """The auto-captured clean run (None before the start event or when there is none)."""
        return self.result.meta.get("captured_source_run") if self.result else None

    @property
    def sweep_id(self) -> str | None:
        return self.result.meta.get("sweep_id") if self.result else None


def result_from_events(events: Iterable[Mapping[str, Any] | SweepEventModel]) -> SweepResult:
    """The result of a stream's events (`[DONE]` removed): the summary's when it came, else the
    cells so far. Raises ValueError when there was no `start` or `summary` event, and
    `SweepEventError` (a ValueError) for a malformed event."""
    fold = SweepFold()
    for ev in events:
        fold.apply(ev)
    if fold.result is None:
        raise ValueError("the stream had no 'start' or 'summary' event")
    return fold.result


def _int_or_none(x: Any) -> int | None:
    try:
        return int(x)
    except (TypeError, ValueError):
        return None


__all__ = ["CellKey", "CellStatus", "SweepFold", "result_from_events", "result_statuses", "status_grid"]

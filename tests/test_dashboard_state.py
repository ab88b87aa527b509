"""`SweepState` (the dashboard's `SweepFold`): folding a patch sweep's SSE events into grids, cell
statuses, progress, noise floor and checksum (pure; no engine, no browser). The canned events have
the shapes the server sends (`app/sweep/service.py`; wire format in `app/sweep/schema.py`)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from app.dashboard.tracing.state import SweepState
from app.sweep.fold import CellStatus

LAYERS, POSITIONS = [0, 1, 2], [0, 1, 2, 3]


class Clock:
    """A hand-driven monotonic clock."""

    def __init__(self, t: float = 100.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def start_event(*, hooks=("post_block",), metric="recovered", cells_total=None, corrupt=-13.85, clean=-0.007,
                unaligned=(), **extra) -> dict:
    ev = {
        "type": "start", "sweep_id": "sw-test", "layers": LAYERS, "positions": POSITIONS, "hook": hooks[0],
        "hooks": list(hooks), "metric": metric, "metric_requested": metric, "auto_captured": True,
        "captured_source_run": "sweep-run1", "clean": clean, "corrupt": corrupt,
        "alignment": {"n_clean": 4, "n_corrupt": 4, "prefix_len": 1, "suffix_len": 2,
                      "unaligned_positions": list(unaligned), "position_map": {}},
        "token_strings": ["<s>", "Garrow", "is", "ruled"], "model": "causalboard-tiny",
    }
    if cells_total is not None:
        ev["cells_total"] = cells_total
    ev.update(extra)
    return ev


def cell(layer: int, position: int, value: float | None, hook: str = "post_block", error: str | None = None) -> dict:
    ev = {"type": "cell", "hook": hook, "layer": layer, "position": position, "value": value}
    if error is not None:
        ev["error"] = error
    return ev


def fold(events, clock=None) -> SweepState:
    state = SweepState(clock=clock or Clock())
    for ev in events:
        state.apply(ev)
    return state


def test_start_sets_axes_and_every_cell_pending():
    state = fold([start_event(hooks=("pre_attn", "post_block"), cells_total=24)])
    assert state.result.layers == LAYERS and state.result.positions == POSITIONS
    assert state.result.hooks == ["pre_attn", "post_block"]
    assert state.cells_total == 24 and state.cells_done == 0
    assert state.count(CellStatus.PENDING) == 24
    assert state.axes_changed
    assert len(state.take_dirty()) == 24 and state.take_dirty() == set()
    assert state.source_run == "sweep-run1" and state.sweep_id == "sw-test"


def test_cells_fill_values_and_mark_only_changed_cells_dirty():
    state = fold([start_event(cells_total=12)])
    state.take_dirty()
    state.apply(cell(1, 2, 0.75))
    state.apply(cell(2, 0, -0.25))
    assert state.take_dirty() == {("post_block", 1, 2), ("post_block", 2, 0)}
    assert state.cell("post_block", 1, 2) == (0.75, CellStatus.DONE, "")
    assert state.result.grids["post_block"][2, 0] == -0.25
    assert math.isnan(state.result.grids["post_block"][0, 0])
    assert state.cells_done == 2 and state.fraction_done == pytest.approx(2 / 12)


def test_voided_cell_after_its_value_blanks_it_without_double_counting():
    state = fold([start_event(cells_total=12), cell(1, 1, 0.5), cell(0, 0, 0.1)])
    assert state.cells_done == 2
    state.take_dirty()
    state.apply(cell(1, 1, None, error="source run evicted"))
    value, status, reason = state.cell("post_block", 1, 1)
    assert math.isnan(value) and status is CellStatus.VOIDED and reason == "source run evicted"
    assert state.cells_done == 2, "a voided cell is the second event of a counted cell"
    assert state.cells_voided == 1
    assert state.take_dirty() == {("post_block", 1, 1)}
    # the same voided event again (a replayed stream) changes nothing
    state.apply(cell(1, 1, None, error="source run evicted"))
    assert (state.cells_done, state.cells_voided) == (2, 1)
    # a cell voided before it ever had a value counts once, as done and voided
    state.apply(cell(2, 3, None, error="capacity"))
    assert (state.cells_done, state.cells_voided) == (3, 2)
    assert state.count(CellStatus.VOIDED) == 2


def test_skip_events_mark_the_whole_column_with_its_reason():
    reason = "unaligned: clean/corrupt token spans differ here (no positional correspondence)"
    state = fold([start_event(), {"type": "skip", "position": 2, "reason": reason}])
    for i in range(len(LAYERS)):
        assert state.cell("post_block", i, 2)[1:] == (CellStatus.SKIPPED, reason)
    assert state.skipped_positions == {2: reason}
    # without a server count, the total is hooks x layers x aligned positions
    assert state.cells_total == 1 * 3 * 3
    assert state.count(CellStatus.PENDING) == 9


def test_unaligned_positions_of_the_start_event_are_skipped_at_once():
    state = fold([start_event(unaligned=[1])])
    assert state.cell("post_block", 0, 1)[1] is CellStatus.SKIPPED
    state.apply({"type": "skip", "position": 1, "reason": "unaligned: differs"})
    assert state.cell("post_block", 2, 1)[2] == "unaligned: differs"  # the server's reason wins


def test_noise_floor_flags_cells_within_it_for_recovered():
    state = fold([start_event(), cell(0, 0, 0.0004), cell(0, 1, -0.002), cell(1, 1, 0.9)])
    assert state.count(CellStatus.NOISE) == 0  # no floor yet
    state.take_dirty()
    state.apply({"type": "noise_floor", "value": 0.001, "solo": -13.85, "in_batch": [-13.8501], "units": "recovered"})
    assert state.noise_floor == 0.001
    assert state.cell("post_block", 0, 0)[1] is CellStatus.NOISE  # |0.0004| <= 0.001
    assert state.cell("post_block", 0, 1)[1] is CellStatus.DONE  # |-0.002| > 0.001
    assert state.take_dirty() == {("post_block", 0, 0)}  # only the re-flagged cell
    state.apply(cell(2, 2, -0.0009))  # cells after the floor are flagged on arrival
    assert state.cell("post_block", 2, 2)[1] is CellStatus.NOISE
    # a larger floor later re-flags earlier cells
    state.apply({"type": "noise_floor", "value": 0.01, "final": True})
    assert state.cell("post_block", 0, 1)[1] is CellStatus.NOISE
    assert state.count(CellStatus.NOISE) == 3 and state.cells_done == 4


def test_noise_floor_of_raw_metrics_is_measured_from_the_corrupt_baseline():
    state = fold([start_event(metric="logprob", corrupt=-5.0), cell(0, 0, -5.02), cell(0, 1, -1.0),
                  {"type": "noise_floor", "value": 0.05}])
    assert state.cell("post_block", 0, 0)[1] is CellStatus.NOISE  # |-5.02 - -5.0| <= 0.05
    assert state.cell("post_block", 0, 1)[1] is CellStatus.DONE
    # without a corrupt baseline the effect is unknown: no cell is called noise
    state = fold([start_event(metric="logprob", corrupt=None), cell(0, 0, -5.02), {"type": "noise_floor", "value": 0.05}])
    assert state.cell("post_block", 0, 0)[1] is CellStatus.DONE


def test_progress_and_cells_per_second_follow_the_clock():
    clock = Clock(100.0)
    state = fold([start_event(cells_total=12)], clock)
    assert state.cells_per_s is None and state.elapsed_s == 0.0
    clock.t = 100.5
    state.apply(cell(0, 0, 0.1))
    clock.t = 101.0
    state.apply(cell(0, 1, 0.2))
    state.apply(cell(0, 2, 0.3))
    state.apply(cell(0, 2, 0.3))  # a duplicate (replayed) event is not a new cell
    assert state.cells_done == 3
    assert state.cells_per_s == pytest.approx(3 / 1.0)
    clock.t = 103.0
    assert state.elapsed_s == pytest.approx(3.0)
    assert state.cells_per_s == pytest.approx(3.0)  # measured to the last cell, not to now
    # the server's rate wins (it sees the cells as they complete, not in bursts)
    state.apply({"type": "progress", "done": 3, "total": 10, "voided": 0, "elapsed_s": 3.0, "cells_per_s": 1.5})
    assert state.cells_total == 10 and state.cells_per_s == 1.5
    # once finished: done / the server's elapsed time
    state.apply(summary_event(cells_done=8, elapsed_s=4.0))
    assert state.cells_per_s == pytest.approx(2.0) and state.elapsed_s == 4.0


def test_no_rate_from_a_burst():
    clock = Clock(5.0)
    state = fold([start_event(), cell(0, 0, 0.1), cell(0, 1, 0.1)], clock)  # all in one flush
    assert state.cells_done == 2 and state.cells_per_s is None


def test_unknown_and_out_of_place_events_are_ignored():
    state = SweepState(clock=Clock())
    state.apply(cell(0, 0, 1.0))  # before start: nothing to draw it on
    state.apply({"type": "skip", "position": 1, "reason": "x"})
    assert state.result is None and state.ignored_events == 2
    state.apply(start_event())
    for ev in ({"type": "mystery", "layer": 0}, cell(7, 0, 1.0), cell(0, 9, 1.0), cell(0, 0, 1.0, hook="mlp_out")):
        state.apply(ev)
    assert state.ignored_events == 6  # (malformed events raise: tests/test_sweep_schema.py)
    assert state.cells_done == 0 and state.count(CellStatus.PENDING) == 12
    state.apply({"type": "warning", "message": "recovered is undefined"})
    state.apply({"type": "error", "error": "engine: stopped"})
    assert state.warnings == ["recovered is undefined"] and state.errors == ["engine: stopped"]


def test_checksum_text_reports_consistency_and_mismatched_ranks():
    state = SweepState()
    assert state.checksum_text() == "pending"
    state.apply({"type": "checksum", "consistent": True, "action_count": 30, "ranks": 1, "workers": []})
    assert state.checksum_text() == "consistent (1 rank)"
    state.apply({"type": "checksum", "consistent": False, "ranks": 2,
                 "mismatches": {"pp0": {"tp0/pp0": "aa", "tp1/pp0": "bb"}}})
    assert state.checksum_text() == "mismatch (tp0/pp0 ≠ tp1/pp0)"
    state.apply({"type": "checksum", "consistent": None, "error": "engine gone"})
    assert state.checksum_text() == "unavailable (engine gone)"


def summary_event(**over) -> dict:
    grid = [[0.0001, 1.0, None, 0.2], [None, 0.5, None, 0.1], [0.0, 0.25, None, None]]
    ev = {
        "type": "summary", "sweep_id": "sw-test", "layers": LAYERS, "positions": POSITIONS, "hook": "post_block",
        "hooks": ["post_block"], "metric": "recovered", "grid": grid, "argmax": None, "hook_grids": None,
        "clean": -0.007, "corrupt": -13.85, "noise_floor": 0.001,
        "within_noise": [{"hook": "post_block", "layer": 0, "position": 0}, {"hook": "post_block", "layer": 2, "position": 0}],
        "skipped": [{"position": 2, "reason": "unaligned: differs"},
                    {"hook": "post_block", "layer": 1, "position": 0, "reason": "voided: evicted"}],
        "alignment": {"n_clean": 4, "n_corrupt": 4, "prefix_len": 1, "suffix_len": 1, "unaligned_positions": [2]},
        "checksum": {"consistent": True, "ranks": 1}, "cells_total": 9, "cells_done": 8, "cells_voided": 1,
        "cancelled": False, "notes": ["a note"], "captured_source_run": "sweep-run1", "source_kept": True,
        "token_strings": ["<s>", "Garrow", "is", "ruled"],
    }
    ev.update(over)
    return ev


def test_summary_is_authoritative():
    # a stream that missed some cells: the summary fills the gaps and sets every status
    state = fold([start_event(), cell(0, 1, 1.0)])
    state.axes_changed = False  # the view rebuilt its figures
    state.apply(summary_event())
    assert not state.axes_changed  # same axes: the figures stay
    assert state.finished and not state.cancelled
    g = state.result.grids["post_block"]
    assert g[0, 3] == 0.2 and g[2, 1] == 0.25 and math.isnan(g[0, 2])
    st = state.status["post_block"]
    assert st[0, 0] is CellStatus.NOISE and st[2, 0] is CellStatus.NOISE
    assert st[1, 0] is CellStatus.VOIDED and state.reasons[("post_block", 1, 0)] == "voided: evicted"
    assert all(st[i, 2] is CellStatus.SKIPPED for i in range(3))
    assert st[2, 3] is CellStatus.PENDING  # no value and no reason: never computed
    assert st[0, 1] is CellStatus.DONE
    assert (state.cells_done, state.cells_voided, state.cells_total) == (8, 1, 9)
    assert state.noise_floor == 0.001 and state.checksum_text() == "consistent (1 rank)"
    assert "a note" in state.warnings
    assert len(state.take_dirty()) == 12


def test_summary_alone_and_cancelled():
    state = fold([summary_event(cancelled=True, within_noise=[])])
    assert state.finished and state.cancelled and state.axes_changed
    assert state.count(CellStatus.NOISE) == 0
    assert state.count(CellStatus.DONE) == 7
    assert np.array_equal(state.result.to_numpy(), state.result.grids["post_block"], equal_nan=True)

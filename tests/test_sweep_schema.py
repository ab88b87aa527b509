"""The sweep's wire format (`app/sweep/schema.py`): what the real server sends conforms to it
exactly (every event to `SweepEvent`, summaries to `SweepSummary`, the running state to
`SweepStatus`), and the one event reader (`app/sweep/fold.py`) rejects malformed events naming
the field. The first tests need no engine."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np
import pytest
from pydantic import TypeAdapter

from app.sweep.fold import SweepFold, result_from_events
from app.sweep.result import SweepResult
from app.sweep.schema import (EVENT_TYPES, SWEEP_EVENT, CellEvent, SummaryEvent, SweepEventError, SweepStatus, SweepSummary,
                              event_json_schema)
from tests.sse import sse_events
from tests.test_dashboard_state import cell, start_event, summary_event

from .conftest import REPO


# ---- no engine ------------------------------------------------------------------------------------
def test_app_sweep_never_imports_plotting_or_the_web_stack():
    code = ("import sys, app.sweep.fold, app.sweep.service, app.sweep.result, app.sweep.schema; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('matplotlib', 'fastapi', 'panel', 'bokeh') "
            "or m.startswith('app.figures')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_malformed_event_is_rejected_by_the_fold_with_the_field():
    fold = SweepFold()
    fold.apply(start_event(cells_total=12))
    fold.apply(cell(0, 0, 0.5))
    fold.take_dirty()
    bad = [({"type": "cell", "layer": 1, "value": 0.3}, "cell.position", "Field required"),
           ({**cell(1, 1, 0.2), "value": "high"}, "cell.value", "valid number"),
           ({"type": "progress", "done": 3}, "progress.total", "Field required"),
           ({"type": "warning"}, "warning.message", "Field required"),
           ({"type": "start", "layers": [0], "positions": [0], "hook": "post_block", "metric": "kl", "sweep_id": "s"},
            "start.metric", "'logprob'"),
           ({**summary_event(), "hook_grids": [{"hook": "post_block", "grid": "none"}]}, "summary.hook_grids.0.grid", "valid list"),
           ({"layer": 0}, "type", "missing")]
    for ev, field, words in bad:
        with pytest.raises(SweepEventError) as info:
            fold.apply(ev)
        assert info.value.field == field and words in info.value.message, (field, str(info.value))
        assert str(info.value) == f"{field}: {info.value.message}"
    # nothing changed
    assert (fold.cells_done, fold.ignored_events, fold.finished, fold.take_dirty()) == (1, 0, False, set())
    assert fold.result.metric == "recovered" and fold.server_cells_total == 12
    # unknown event types and unknown fields are not malformed: newer servers may send them
    assert fold.apply({"type": "heartbeat", "at": 3}) is None and fold.ignored_events == 1
    typed = fold.apply({**cell(1, 1, 0.2), "confidence": 0.9})
    assert isinstance(typed, CellEvent) and fold.cells_done == 2


def test_result_from_events_equals_the_summary_and_lists_skips_and_voids():
    events = [start_event(cells_total=9), {"type": "skip", "position": 2, "reason": "unaligned: differs"},
              cell(0, 1, 1.0), cell(1, 0, 0.4), cell(1, 0, None, error="voided: evicted"), {"type": "noise_floor", "value": 0.001}]
    live = result_from_events(events)
    assert live.noise_floor == 0.001 and np.isnan(live.grids["post_block"][1, 0]) and live.grids["post_block"][0, 1] == 1.0
    assert live.skipped == [{"position": 2, "reason": "unaligned: differs"},
                            {"hook": "post_block", "layer": 1, "position": 0, "reason": "voided: evicted"}]
    final = result_from_events(events + [summary_event()])
    assert np.array_equal(final.to_numpy(), SweepResult.from_summary(summary_event()).to_numpy(), equal_nan=True)
    with pytest.raises(ValueError, match="no 'start' or 'summary'"):
        result_from_events([{"type": "warning", "message": "x"}])


def test_the_event_schema_is_self_contained_and_lists_every_type():
    schema = event_json_schema()
    assert "$ref" not in json.dumps(schema)
    assert [v["properties"]["type"]["const"] for v in schema["oneOf"]] == list(EVENT_TYPES)
    cell_schema = next(v for v in schema["oneOf"] if v["properties"]["type"]["const"] == "cell")
    assert set(cell_schema["required"]) == {"type", "hook", "layer", "position", "value"}  # error/raw: only when set
    assert cell_schema["additionalProperties"] is False


# ---- the real server -----------------------------------------------------------------------------
def _pair(tasks, equal: bool) -> dict:
    return next(p for p in tasks["pairs"] if p["equal_length"] == equal)


def _strict(ev: dict):
    """The event as the server's model (no unknown key accepted); its JSON equals the event."""
    model = SWEEP_EVENT.validate_python(ev)
    assert model.model_dump(mode="json") == ev, ev["type"]
    return model


def test_every_event_and_summary_the_server_sends_conforms_exactly(http, engine, tasks):
    # unequal lengths: skip events; a clean_baseline that is ignored: a warning; a stored run
    # dropped after two cells: voided cells
    pair = _pair(tasks, equal=False)
    engine.capture(pair["clean_prompt"], [f"L{l}.post_block" for l in range(engine.info.num_layers)], "all_prompt",
                   keep_as="schema-doomed", return_values=False)
    body = {"prompt": pair["corrupt_prompt"], "clean_prompt": pair["clean_prompt"], "source_run": "schema-doomed",
            "answer_token_id": pair["answer_id"], "foil_token_id": pair["foil_id"], "metric": "recovered",
            "clean_baseline": 0.0, "max_concurrency": 1, "noise_floor_samples": 2, "stream": True}
    events: list[dict] = []
    try:
        with http.stream("POST", "/v1/patch_sweep", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    events.append(json.loads(line[6:]))
                    if events[-1]["type"] == "cell" and sum(e["type"] == "cell" for e in events) == 2:
                        assert engine.drop_source("schema-doomed")
    finally:
        engine.drop_source("schema-doomed")
    models = [_strict(ev) for ev in events]
    kinds = {ev["type"] for ev in events}
    assert {"start", "warning", "skip", "checksum", "cell", "noise_floor", "progress", "summary"} <= kinds
    cells = [ev for ev in events if ev["type"] == "cell"]
    assert {tuple(sorted(ev)) for ev in cells} == {("hook", "layer", "position", "raw", "type", "value"),
                                                   ("error", "hook", "layer", "position", "type", "value")}
    checksum = next(ev for ev in events if ev["type"] == "checksum")
    assert set(checksum) == {"type", "consistent", "action_count", "ranks", "workers"}
    summary = models[-1]
    assert isinstance(summary, SummaryEvent) and summary.cells_voided and not summary.cancelled
    assert set(events[-1]) == {"type"} | set(SweepSummary.model_fields) - {"mask"} and events[0]["type"] == "start"  # no mask: absent
    assert list(events[0])[0] == "type" and events[0]["source"] == {"kind": "run", "run_id": "schema-doomed"}

    # the JSON answer and GET by id: the same summary, exactly a SweepSummary
    plain = http.post("/v1/patch_sweep", json={**body, "stream": False, "source_run": None, "clean_baseline": None,
                                               "layers": [0, 1]})
    assert plain.status_code == 200, plain.text
    answer = plain.json()
    assert SweepSummary.model_validate(answer).model_dump(mode="json") == answer
    by_id = http.get(f"/v1/patch_sweep/{answer['sweep_id']}").json()
    assert by_id == answer
    replay = [d for _, d in sse_events(http.get(f"/v1/patch_sweep/{answer['sweep_id']}/events").text)[:-1]]
    for ev in replay:
        _strict(ev)
    assert {k: v for k, v in replay[-1].items() if k != "type"} == answer


def test_a_running_sweep_answers_its_status(http, tasks):
    f = tasks["facts"][6]
    body = {"prompt": f["prompt"], "noise": {"span": f["subject"], "samples": 8}, "answer_token_id": f["answer_id"],
            "metric": "recovered", "hooks": ["pre_attn", "post_attn", "post_block"], "max_concurrency": 1, "stream": True}
    status = None
    with http.stream("POST", "/v1/patch_sweep", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                start = json.loads(line[6:])
                status = http.get(f"/v1/patch_sweep/{start['sweep_id']}").json()
                break  # closing the stream cancels the sweep
    assert status is not None
    assert SweepStatus.model_validate(status).model_dump(mode="json") == status
    assert status["state"] == "running" and status["cells_done"] < status["cells_total"]
    deadline = time.time() + 30
    while "state" in (after := http.get(f"/v1/patch_sweep/{start['sweep_id']}").json()) and time.time() < deadline:
        time.sleep(0.1)
    assert TypeAdapter(SweepSummary | SweepStatus).validate_python(after).cancelled is True


@pytest.mark.parametrize("device,batch_invariant,expected", [("cpu", True, True), ("cpu", False, False),
                                                               ("cuda", True, True), ("cuda", False, False)])
def test_prefix_reuse_is_on_by_default_only_where_reused_cells_are_exact(device, batch_invariant, expected):
    """Engines with batch invariance (the default on CPU and GPU) reuse by default (shown
    bit-identical: tests/test_sweep_prefix_reuse.py, benchmarks/gpu_sweep.py `prefix_reuse_exact`);
    without it no cell is computed exactly twice on every host, so there it is opt-in."""
    from types import SimpleNamespace

    from app.sweep.service import prefix_reuse_default

    assert prefix_reuse_default(SimpleNamespace(device=device, batch_invariant=batch_invariant)) is expected

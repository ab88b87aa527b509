"""`TracingView` driven through its parameters from Python against the real API (`server_url`, the
shared CPU engine) — the way a notebook uses it: no browser, the view's own asyncio task and
periodic callback on the running event loop — and its clean-up where no browser session ends it:
`aclose()`, and a kernel (any Python process) that exits with a sweep running and a run kept."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import time

import pytest

from app.dashboard.tracing.view import TracingView
from app.sweep.fold import CellStatus
from tests.conftest import REPO

pytestmark = pytest.mark.engine


def run(coro, timeout: float = 180.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def kept_runs(http) -> list[str]:
    return [r["run_id"] for r in http.get("/v1/status").json()["source_store"]["runs"]]


def test_sweep_then_zoom_in_a_kernel_loop(server_url, http, engine):
    async def main():
        view = TracingView(server_url)
        view.hooks = ["pre_attn", "post_block"]
        view.param.trigger("run_sweep")
        assert view.phase == "running"
        state = await view.wait(timeout=120)
        assert view.phase == "done" and state.finished and not state.cancelled
        assert state.cells_done == state.cells_total == 2 * engine.info.num_layers * len(state.result.positions)
        assert view.progress == 1.0 and view.sweep_id == state.sweep_id and view.result is state.result
        assert {h: hm.filled_cells() for h, hm in view.heatmaps.items()} == {
            "pre_attn": state.cells_total // 2, "post_block": state.cells_total // 2}
        assert state.checksum_text().startswith("consistent") and state.noise_floor is not None
        kept = view.kept_run
        assert kept is not None and kept == state.result.meta["captured_source_run"] and not view.b_zoom.disabled
        # zoom on (layers 2-3) x (positions 1-2) of post_block, selected as the box tool would
        hm = view.heatmaps["post_block"]
        n_p = len(hm.positions)
        hm.source.selected.indices = [2 * n_p + 1, 3 * n_p + 2]
        assert view.selection == ([2, 3], [1, 2])
        view.param.trigger("zoom_in")
        zoomed = await view.wait(timeout=120)
        assert view.zoomed and zoomed.result.layers == [2, 3] and zoomed.result.positions == [1, 2]
        assert zoomed.result.meta["source"] == {"kind": "run", "run_id": kept}
        assert view.kept_run == kept  # a zoom keeps using the same run
        # the zoom's values equal the first sweep's at the same cells (same run, same patches)
        first = state.result.grids["post_block"]
        for i, layer in enumerate([2, 3]):
            for j, pos in enumerate([1, 2]):
                assert zoomed.result.grids["post_block"][i, j] == pytest.approx(first[layer, pos], abs=1e-6)
        assert kept in kept_runs(http)
        await view.aclose()  # the notebook's clean-up: the kept run is dropped
        return kept

    kept = run(main())
    assert kept not in kept_runs(http)


def test_sweep_runs_without_zoom_when_the_kept_run_does_not_fit(server_url, http, engine):
    """The test engine's source store is 2 MiB: keeping every hook of a ~70-token clean run for
    zooms does not fit (507), the sweep itself (one hook) does. The view then sweeps without
    keeping the run and says zoom is off."""
    clean, corrupt = " ".join(["Guzar is ruled by"] * 17), " ".join(["Garrow is ruled by"] * 17)
    assert http.post("/v1/tokenize", json={"prompt": clean}).json()["count"] > 60

    async def main():
        view = TracingView(server_url)
        view.param.update(clean_prompt=clean, corrupt_prompt=corrupt, subject="")
        view.param.trigger("run_sweep")
        state = await view.wait(timeout=150)
        await view.aclose()
        return view, state

    view, state = run(main())
    assert not view.error, (view.error, http.get("/v1/status").json()["sweeps"], http.get("/v1/patch_source").json())
    assert view.phase == "done"
    assert state.finished and state.cells_done == state.cells_total == engine.info.num_layers * len(state.result.positions)
    assert any(w.startswith("zoom is off for this sweep") for w in state.warnings)
    assert view.kept_run is None and view.b_zoom.disabled
    assert state.count(CellStatus.PENDING) == 0


@pytest.mark.parametrize("fault", ["render", "fold", "fold_task_killed"])
def test_a_failing_or_dead_fold_never_leaves_the_view_running(server_url, http, engine, monkeypatch, fault):
    """The periodic fold is what moves the view out of `running`: showing the sweep failing once,
    folding one event failing, or the fold's task dying must not leave it running for ever (the
    notebook's `await view.wait()` would hang) nor lose the events after the failure."""
    from app.dashboard.tracing.state import SweepState

    if fault == "fold":
        apply = SweepState.apply
        failed = []

        def apply_once_failing(self, ev):
            if ev.get("type") == "progress" and not failed:
                failed.append(ev)
                raise RuntimeError("injected fold fault")
            return apply(self, ev)

        monkeypatch.setattr(SweepState, "apply", apply_once_failing)

    async def main():
        view = TracingView(server_url)
        view.hooks = ["post_block"]
        if fault == "render":
            push = view._push_cells
            calls = []

            def push_once_failing():
                calls.append(1)
                if len(calls) == 1:
                    raise RuntimeError("injected render fault")
                push()

            view._push_cells = push_once_failing
        view.param.trigger("run_sweep")
        if fault == "fold_task_killed":
            view._flush_task.cancel()
            await asyncio.sleep(0)
            assert view._flush_task.done()
        state = await view.wait(timeout=60)
        await view.aclose()
        return view, state

    view, state = run(main())
    assert view.phase == "done" and state.finished and state.cells_done == state.cells_total
    assert state.count(CellStatus.PENDING) == 0
    if fault == "render":
        assert view.error.startswith("showing the sweep failed: RuntimeError: injected render fault")
        hm = view.heatmaps["post_block"]
        assert hm.filled_cells() == state.cells_total  # the cells of the failed push were pushed later
    elif fault == "fold":
        assert view.error == "folding a sweep event failed: RuntimeError: injected fold fault"
    else:
        assert not view.error


def test_cancel_then_aclose_mid_sweep(server_url, http):
    """Cancel shows the server's cancelled summary; closing the view while a sweep runs cancels
    it on the server."""

    async def main():
        view = TracingView(server_url)
        view.param.update(hooks=["pre_attn", "post_attn", "post_block"], max_concurrency=1)
        view.param.trigger("run_sweep")
        while view.state.cells_done < 2:
            await asyncio.sleep(0.05)
        view.param.trigger("cancel_sweep")
        assert view.phase == "cancelled" and view.b_cancel.disabled
        state = await view.wait(timeout=60)
        assert state.finished and state.cancelled and view.phase == "cancelled"
        cancelled = state.sweep_id
        view.param.trigger("run_sweep")
        while view.state.sweep_id in (None, cancelled) or view.state.cells_done < 1:
            await asyncio.sleep(0.05)
        running = view.state.sweep_id
        await view.aclose()
        return cancelled, running

    cancelled, running = run(main())
    for sid in (cancelled, running):
        summary = wait_for_summary(http, sid)
        assert summary["cancelled"] is True and summary["cells_done"] < summary["cells_total"]
        assert not summary.get("source_kept")


def wait_for_summary(http, sid: str, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        body = http.get(f"/v1/patch_sweep/{sid}").json()
        if "layers" in body:
            return body
        time.sleep(0.1)
    raise AssertionError(f"no summary of {sid}")


KERNEL = """
import asyncio
from app.dashboard.tracing.view import TracingView

async def main():
    view = TracingView()  # $CAUSALBOARD_URL
    # a zoom long enough to exit in the middle of it on a fast CPU too: ~30 positions x 8 layers x
    # 3 hooks, one cell at a time (the kept clean run, every hook of ~30 tokens, fits the store)
    clean, corrupt = " ".join(["Guzar is ruled by"] * 7), " ".join(["Garrow is ruled by"] * 7)
    view.param.update(clean_prompt=clean, corrupt_prompt=corrupt, subject="",
                      hooks=["pre_attn", "post_attn", "post_block"], max_concurrency=1)
    view.param.trigger("run_sweep")
    await view.wait(timeout=120)
    assert view.kept_run, view.status_html
    view.selection = (view.result.layers, view.result.positions)
    view.param.trigger("zoom_in")  # the whole grid again, from the kept run
    while view.state.cells_done < 2:
        await asyncio.sleep(0.05)
    print("KEPT", view.kept_run, "RUNNING", view.sweep_id, flush=True)

asyncio.run(main())  # then the interpreter exits with the zoom running and the run kept
"""


def test_an_exiting_kernel_cancels_its_sweep_and_drops_its_kept_run(server_url, http):
    env = {**os.environ, "CAUSALBOARD_URL": server_url}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(KERNEL)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    words = proc.stdout.split()
    kept, running = words[words.index("KEPT") + 1], words[words.index("RUNNING") + 1]
    summary = wait_for_summary(http, running)
    assert summary["cancelled"] is True and summary["cells_done"] < summary["cells_total"], (
        {k: summary.get(k) for k in ("cancelled", "cells_done", "cells_total")}, proc.stderr[-2000:])
    assert kept not in kept_runs(http)

"""`TracingView` driven from Python against the real API (`server_url`, the shared CPU engine) —
the way a notebook uses it: no browser, the view's own asyncio task and periodic callback on the
running event loop."""

from __future__ import annotations

import asyncio

import pytest

from app.sweep.fold import CellStatus
from app.dashboard.tracing.view import TracingView

pytestmark = pytest.mark.engine


def run(coro, timeout: float = 180.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def test_sweep_then_zoom_in_a_kernel_loop(server_url, http, engine):
    async def main():
        view = TracingView(server_url)
        request = view.form().to_request()
        request["hooks"] = ["pre_attn", "post_block"]
        view.start(request)
        state = await view.wait(timeout=120)
        assert state.finished and not state.cancelled
        assert state.cells_done == state.cells_total == 2 * engine.info.num_layers * len(state.result.positions)
        assert {h: hm.filled_cells() for h, hm in view.heatmaps.items()} == {
            "pre_attn": state.cells_total // 2, "post_block": state.cells_total // 2}
        assert state.checksum_text().startswith("consistent") and state.noise_floor is not None
        kept = view.kept_run
        assert kept is not None and kept == state.result.meta["captured_source_run"]
        # zoom on (layers 2-3) x (positions 1-2) of post_block, selected as the box tool would
        hm = view.heatmaps["post_block"]
        n_p = len(hm.positions)
        hm.source.selected.indices = [2 * n_p + 1, 3 * n_p + 2]
        view.zoom()
        zoomed = await view.wait(timeout=120)
        assert zoomed.result.layers == [2, 3] and zoomed.result.positions == [1, 2]
        assert zoomed.result.meta["source"] == {"kind": "run", "run_id": kept}
        assert view.kept_run == kept  # a zoom keeps using the same run
        # the zoom's values equal the first sweep's at the same cells (same run, same patches)
        first = state.result.grids["post_block"]
        for i, layer in enumerate([2, 3]):
            for j, pos in enumerate([1, 2]):
                assert zoomed.result.grids["post_block"][i, j] == pytest.approx(first[layer, pos], abs=1e-6)
        await view.client.aclose()
        return kept

    kept = run(main())
    assert kept in [r["run_id"] for r in http.get("/v1/status").json()["source_store"]["runs"]]
    assert http.delete(f"/v1/patch_source/{kept}").status_code == 200


def test_sweep_runs_without_zoom_when_the_kept_run_does_not_fit(server_url, http, engine):
    """The test engine's source store is 2 MiB: keeping every hook of a ~70-token clean run for
    zooms does not fit (507), the sweep itself (one hook) does. The view then sweeps without
    keeping the run and says zoom is off."""
    clean, corrupt = " ".join(["Guzar is ruled by"] * 17), " ".join(["Garrow is ruled by"] * 17)
    assert http.post("/v1/tokenize", json={"prompt": clean}).json()["count"] > 60

    async def main():
        view = TracingView(server_url)
        view.w_clean.value, view.w_corrupt.value, view.w_subject.value = clean, corrupt, ""
        view.run_form()
        state = await view.wait(timeout=150)
        await view.client.aclose()
        return view, state

    view, state = run(main())
    assert not view.error.visible, (view.error.object, http.get("/v1/status").json()["sweeps"], http.get("/v1/patch_source").json())
    assert state.finished and state.cells_done == state.cells_total == engine.info.num_layers * len(state.result.positions)
    assert any(w.startswith("zoom is off for this sweep") for w in state.warnings)
    assert view.kept_run is None and view.b_zoom.disabled
    assert state.count(CellStatus.PENDING) == 0

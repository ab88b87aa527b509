"""SteeringView (app/dashboard/steering/view.py) driven through its parameters against the real server:
baseline vs steered streams, debounced slider moves, cancellation of superseded streams."""

from __future__ import annotations

import asyncio

import pytest

from app.dashboard.steering.vectors import contrast_defaults


def _run(coro):
    """Run `coro` on a fresh loop in a worker thread (the session may hold a running loop in the
    main thread, e.g. Playwright's sync API)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, asyncio.wait_for(coro, timeout=300)).result()


def test_view_builds_a_vector_and_steers_only_the_steered_column(server_url, tasks, engine):
    from app.client import CausalboardClient
    from app.dashboard.steering.view import SteeringView

    d = contrast_defaults(tasks)

    async def scenario():
        view = SteeringView(server_url, tasks=tasks)
        try:
            await view.ready()
            assert view.layers == list(range(engine.info.num_layers)) and "causalboard-tiny" in view.model_info
            start = (view.baseline_text, view.runs("baseline"))
            assert view.prompt == d.test_prompt and view.baseline_text.strip()
            assert view.steered_text == view.baseline_text  # nothing selected yet: no intervention
            cv = await view.build_vector()
            await view.wait_idle()
            assert view.selected == [d.name] and "registered" in view.build_status
            ctrl = view.controls[d.name]
            assert (ctrl.site, ctrl.norm) == ("L2.post_block", pytest.approx(cv.norm, rel=1e-5))
            ctrl.scale = 1.5
            await view.wait_idle()
            steered = view.steered_text
            assert view.last_steer == {"steer": [{"sites": ["L2.post_block"], "scale": 1.5, "positions": "all",
                                                  "phase": "both", "name": d.name}]}
            assert "× +1.50" in view.steered_status and "|v| = " in view.steered_status
            # the slider never re-runs the baseline
            assert (view.baseline_text, view.runs("baseline")) == start
            ctrl.layer = 0
            await view.wait_idle()
            assert view.last_steer["steer"][0]["sites"] == ["L0.post_block"]
            return start[0], steered
        finally:
            await view.aclose()

    baseline, steered = _run(scenario())
    assert steered != baseline
    with CausalboardClient(server_url) as client:
        try:
            ref = client.generate(d.test_prompt, max_tokens=16, interventions={"steer": [
                {"sites": ["L2.post_block"], "name": d.name, "scale": 1.5}]})
            assert ref["text"] == steered
            assert client.generate(d.test_prompt, max_tokens=16)["text"] == baseline
        finally:
            client.delete_vector(d.name)


def test_newer_slider_moves_cancel_older_steered_streams(server_url, tasks, http):
    from app.client import CausalboardClient
    from app.dashboard.steering.view import SteeringView

    name = "test_view_cancel"

    async def scenario():
        view = SteeringView(server_url, tasks=tasks, vector_name=name, max_tokens=32)
        try:
            await view.ready()
            await view.build_vector()
            await view.wait_idle()
            ctrl = view.controls[name]
            # debounced: a burst of moves within the quiet time gives one stream, with the last value
            n0 = view.runs("steered")
            view.debounce_s = 0.3
            for scale in (0.2, 0.6, 1.0, 1.4):
                ctrl.scale = scale
                await asyncio.sleep(0.02)
            await view.wait_idle()
            assert view.runs("steered") == n0 + 1
            assert view.last_steer["steer"][0]["scale"] == 1.4
            burst_text = view.steered_text
            # a move while a stream is in flight cancels it (the HTTP stream is closed)
            view.debounce_s = 0.0
            ctrl.scale = -1.0
            first = view._tasks["steered"]
            while not view.steered_status.startswith("streaming"):
                await asyncio.sleep(0)
            ctrl.scale = 1.4
            await view.wait_idle()
            assert first.cancelled()
            assert view.runs("steered") == n0 + 2
            assert view.last_steer["steer"][0]["scale"] == 1.4 and view.steered_text == burst_text
            return view.baseline_text
        finally:
            await view.aclose()

    try:
        _run(scenario())
        assert http.get("/v1/status").json()["in_flight_requests"] == 0
    finally:
        with CausalboardClient(server_url) as client:
            client.delete_vector(name)


def test_view_reports_bad_builder_input_and_lists_server_vectors(server_url, tasks, http):
    import numpy as np

    from app.dashboard.steering.view import SteeringView
    from app.dashboard.steering.vectors import VectorInputError

    async def scenario():
        view = SteeringView(server_url, tasks=tasks)
        try:
            await view.ready()
            view.prompts_b = "  \n"
            with pytest.raises(VectorInputError):
                await view.build_vector()
            assert "prompts_b" in view.build_status
            view.prompts_b, view.vector_name = "The language of Tarn is", "bad name!"
            with pytest.raises(VectorInputError):
                await view.build_vector()
            assert "name" in view.build_status
            hidden = http.get("/v1/status").json()["hidden_size"]
            r = http.post("/v1/steering/vectors", json={"name": "test_listed", "vector": [1.0] * hidden})
            assert r.status_code == 200, r.text
            await view.refresh_vectors()
            assert "test_listed" in view.param.selected.objects
            assert view.vector_info["test_listed"]["norm"] == pytest.approx(np.sqrt(hidden))
            view.selected = ["test_listed"]
            assert view.controls["test_listed"].norm == pytest.approx(np.sqrt(hidden))
            assert http.delete("/v1/steering/vectors/test_listed").status_code == 200
            await view.refresh_vectors()
            assert view.selected == [] and "test_listed" not in view.param.selected.objects
        finally:
            await view.aclose()

    _run(scenario())

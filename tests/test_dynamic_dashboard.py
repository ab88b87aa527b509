"""The dynamic-steering panel (app/dashboard/steering/dynamic.py) driven through its parameters
against the real server, and the strip plot's data and figure (app/figures/dynamic_trace.py)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from app.figures.dynamic_trace import plot_trace, trace_rows


def _run(coro):
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, asyncio.wait_for(coro, timeout=300)).result()


GEN = {"token_ids": [5, 6, 7], "intervention": {"dynamic": {"trace": [[
    {"position": 4, "score": -1.0, "threshold": 0.5, "engaged": False, "scale": 0.0},
    {"position": 5, "score": 2.0, "threshold": 0.5, "engaged": False, "scale": 0.0},
    {"position": 6, "score": 1.0, "threshold": 0.0, "engaged": True, "scale": 1.0}]]}}}


def test_trace_rows_and_the_exported_strip_plot():
    rows = trace_rows(GEN, token_strings=[" a", " b", " c"])
    assert [(r["token"], r["score"], r["threshold"], r["engaged"]) for r in rows] == [
        (" a", -1.0, 0.5, False), (" b", 2.0, 0.5, False), (" c", 1.0, 0.0, True)]
    fig = plot_trace(rows, title="t")
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["␣a", "␣b", "␣c"]
    score_line = [ln for ln in ax.get_lines() if ln.get_label() == "probe score"][0]
    assert list(score_line.get_ydata()) == [-1.0, 2.0, 1.0]
    assert len(ax.patches) == 1  # one engaged token shaded
    with pytest.raises(ValueError):
        trace_rows(GEN, policy=1)


def test_panel_generates_with_the_policy_and_plots_its_trace(server_url):
    from app.client import CausalboardClient
    from app.dashboard.steering.dynamic import DynamicTraceView

    rng = np.random.default_rng(3)
    with CausalboardClient(server_url) as c:
        c.register_probe(name="dash-probe", site="L3.post_block", direction=rng.standard_normal(192).tolist())
        c.register_vector("dash-vec", rng.standard_normal(192) * 4.0)

    async def scenario():
        view = DynamicTraceView(server_url)
        try:
            await view.refresh_choices()
            assert "dash-probe" in view.param.probe.objects and "dash-vec" in view.param.vector.objects
            view.param.update(probe="dash-probe", vector="dash-vec", on=-1e30, off=-1e30, layer=2, hook="post_attn",
                              max_tokens=6, ignore_eos=True)
            done = await view.run()
            return view, done
        finally:
            await view.aclose()

    view, done = _run(scenario())
    try:
        assert done["intervention"]["status"] == "ok"
        trace = done["intervention"]["dynamic"]["trace"][0]
        assert [r["score"] for r in view.rows] == [e["score"] for e in trace]
        assert [r["engaged"] for r in view.rows] == [False] + [True] * 5
        assert "".join(r["token"] for r in view.rows) == view.text == done["text"]
        assert view.status.startswith("ok: steering engaged on 5 of 6") and "ranks consistent" in view.status
        assert view.determinism["consistent"] is True
        src = view._source.data
        assert list(src["score"]) == [r["score"] for r in view.rows] and list(src["engaged"]) == [0, 1, 1, 1, 1, 1]
        assert view.plot_pane.object is not None
        assert view.policy() == {"probe": "dash-probe", "mode": "threshold", "sites": ["L2.post_attn"],
                                 "vector_name": "dash-vec", "on": -1e30, "off": -1e30, "min_hold": 0, "scale": 1.0,
                                 "latch": "none"}
    finally:
        with CausalboardClient(server_url) as c:
            c.delete_probe("dash-probe")
            c.delete_vector("dash-vec")


def test_panel_fits_a_probe_from_two_prompt_sets(server_url, tasks):
    from app.client import CausalboardClient
    from app.dashboard.steering.dynamic import DynamicTraceView

    facts = tasks["facts"]

    async def scenario():
        view = DynamicTraceView(server_url)
        try:
            view.param.update(fit_name="dash-fit", fit_layer=4, fit_hook="post_block",
                              fit_positive="\n".join([f["prompt"] for f in facts if f["relation"] == "capital"][:3]),
                              fit_negative="\n".join([f["prompt"] for f in facts if f["relation"] == "river"][:3]))
            out = await view.fit()
            return view, out
        finally:
            await view.aclose()

    view, out = _run(scenario())
    try:
        assert out is not None, view.fit_status
        assert view.probe == "dash-fit" and view.on == out["threshold"] and view.off < view.on
        assert view.fit_status.startswith("fitted dash-fit (direction) at L4.post_block")
        assert min(out["positive_scores"]) > view.on > max(out["negative_scores"])
        assert type(view.__panel__()).__name__ == "Row"  # the layout builds (controls, builder, plot)
    finally:
        with CausalboardClient(server_url) as c:
            c.delete_probe("dash-fit")

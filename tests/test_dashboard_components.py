"""Dashboard pieces without a browser or an engine: the sweep form, the heatmap figure (the
Bokeh data it sends), the tracing view driven through its parameters (recorded events, derived
controls), the client factory, the export file names, and the /dashboard mount on a FastAPI app."""

from __future__ import annotations

import hashlib
import json
import math
import re
from urllib.parse import urljoin

import panel as pn
import pytest

from engine_ext.errors import SpecError

from app.dashboard.tracing.form import NOISE_SPAN, SweepForm, default_form, zoom_request
from app.dashboard.tracing.heatmap import SweepHeatmap, legend_html
from app.figures.presentation import CELL_LOOKS, color_scale, legend_text, position_labels, token_text
from app.sweep.fold import CellStatus
from app.sweep.result import SweepResult
from tests.test_dashboard_state import cell, start_event, summary_event



# ---- form ------------------------------------------------------------------------------------------
def test_form_builds_the_sweep_request():
    form = SweepForm(layers="1-2", positions="span:Garrow", hooks=["pre_attn", "post_block"], metric="logit_diff")
    assert form.to_request() == {
        "prompt": "Garrow is ruled by", "clean_prompt": "Guzar is ruled by", "hooks": ["pre_attn", "post_block"],
        "metric": "logit_diff", "alpha": 1.0, "answer_token": "Hadrian", "foil_token": "Leopold", "max_concurrency": 64,
        "layers": [1, 2], "positions": [{"span": "Garrow", "occurrence": 0}], "subject": {"span": "Garrow", "occurrence": 0},
    }
    assert "subject" not in SweepForm(subject="").to_request()
    noise = SweepForm(corruption=NOISE_SPAN, noise_span="Guzar", noise_scale=2.5, noise_samples=3).to_request()
    assert noise["prompt"] == "Guzar is ruled by" and "clean_prompt" not in noise
    assert noise["noise"] == {"span": "Guzar", "scale": 2.5, "samples": 3, "seed": 0}
    for form, field in ((SweepForm(hooks=[]), "hooks"), (SweepForm(answer=" "), "answer"),
                        (SweepForm(foil="", metric="logit_diff"), "foil"), (SweepForm(corrupt_prompt=""), "corrupt_prompt"),
                        (SweepForm(corruption=NOISE_SPAN, noise_span=""), "noise_span")):
        with pytest.raises(SpecError) as info:
            form.to_request()
        assert info.value.field == field


def test_zoom_request_reuses_the_kept_run():
    base = SweepForm(layers="0:6:2").to_request()
    z = zoom_request(base, [1, 2, 3], [2, 3], "sweep-abc")
    assert z["layers"] == [1, 2, 3] and z["positions"] == [2, 3]
    assert z["source_run"] == "sweep-abc" and z["keep_source"] is True
    assert z["clean_prompt"] == base["clean_prompt"] and z["prompt"] == base["prompt"]
    assert "layers" in base and base["layers"] == [0, 2, 4]  # base untouched


def test_default_form_is_a_real_fact_pair(tmp_path, tasks):
    form = default_form()
    pair = next(p for p in tasks["pairs"] if p["equal_length"] and p.get("hf_top1", True))
    assert (form.clean_prompt, form.corrupt_prompt, form.answer, form.foil) == (
        pair["clean_prompt"], pair["corrupt_prompt"], pair["answer"], pair["foil"])
    assert form.noise_span == pair["subject_clean"] and form.subject == pair["subject_corrupt"]
    other = tmp_path / "tasks.json"
    other.write_text(json.dumps({"pairs": [{"clean_prompt": "A is", "corrupt_prompt": "B is", "answer": " x",
                                            "foil": " y", "equal_length": True}]}))
    assert default_form(other).clean_prompt == "A is" and default_form(other).answer == " x"
    assert default_form(tmp_path / "missing.json") == SweepForm()


# ---- heatmap -------------------------------------------------------------------------------------
def test_token_labels_make_whitespace_visible_and_mark_the_subject():
    assert token_text(" ruled") == "␣ruled" and token_text("a\nb\t") == "a↵b⇥"
    assert token_text("\x00<b>") == "\\x00<b>" and token_text("") == "∅"
    assert position_labels([0, 1, 2, 3], ["<s>", " the", " the", "\n"], subject=[2]) == ["<s>", "␣the", "␣the*", "↵"]
    hm = SweepHeatmap("post_block", [0, 1], [3, 4], [" the", " the"], "recovered", subject=[4])
    # repeated tokens stay apart: the top axis numbers the positions
    assert hm.position_axis.major_label_overrides == {0: "3", 1: "4"}
    assert hm.token_axis.major_label_overrides == {0: "␣the", 1: "␣the*"}
    assert hm.layer_axis.major_label_overrides == {0: "0", 1: "1"}


def test_color_scales_suit_the_metric():
    rec = color_scale("recovered", [])
    assert (rec.low, rec.high) == (-1.0, 1.0) and rec.color(0.0) == "#f7f7f7"  # white centre at 0
    assert rec.color(1.0) == "#67001f" and rec.color(-1.0) == "#053061"
    assert (color_scale("recovered", [0.5, float("nan")]).low, color_scale("recovered", [0.5]).high) == (-1.0, 1.0)
    wild = color_scale("recovered", [-1.7, 0.2])
    assert (wild.low, wild.high) == (-1.5, 1.5) and wild.extend == "min"  # clipped, flagged
    ld = color_scale("logit_diff", [3.2])
    assert (ld.low, ld.high) == (-4.0, 4.0)  # symmetric, grown to a round bound
    lp = color_scale("logprob", [], baselines=[-0.01, -13.8])
    assert (lp.low, lp.high) == (-13.8, -0.01) and lp.diverging is False
    assert color_scale("prob", [0.2]).high == 1.0


def make_heatmap(metric="recovered"):
    return SweepHeatmap("post_attn", [0, 1, 2], [0, 1], ["<s>", " a"], metric)


def test_heatmap_starts_pending_and_patches_only_changed_cells():
    hm = make_heatmap()
    data = hm.source.data
    assert data["x"] == [0, 1] * 3 and data["y"] == [0, 0, 1, 1, 2, 2]
    assert set(data["status_text"]) == {"pending"} and set(data["fill"]) == {CELL_LOOKS[CellStatus.PENDING].fill}
    assert all(math.isnan(v) for v in data["value"])
    hm.update([(1, 0, 0.5, CellStatus.DONE, "")])
    data = hm.source.data
    idx = 1 * 2 + 0
    assert data["value"][idx] == 0.5 and data["value_text"][idx] == "0.5" and data["status_text"][idx] == "ok"
    assert data["fill"][idx] == hm.scale.color(0.5) and data["hatch"][idx] == " "
    assert sum(1 for s in data["status_text"] if s == "pending") == 5
    hm.update([(2, 1, float("nan"), CellStatus.VOIDED, "evicted"), (0, 1, 0.0002, CellStatus.NOISE, "")])
    data = hm.source.data
    assert data["status_text"][5] == "voided — evicted" and data["fill"][5] == CELL_LOOKS[CellStatus.VOIDED].fill
    assert data["hatch"][5] == "x" and data["hatch"][1] == "." and data["fill"][1] == hm.scale.color(0.0002)
    assert hm.filled_cells() == 2


def test_heatmap_recolours_every_cell_when_the_range_grows():
    hm = make_heatmap("logit_diff")
    hm.update([(0, 0, 0.5, CellStatus.DONE, "")])
    before = hm.source.data["fill"][0]
    hm.update([(0, 1, -3.0, CellStatus.DONE, "")])
    assert (hm.mapper.low, hm.mapper.high) == (-3.0, 3.0)
    assert hm.source.data["fill"][0] != before == color_scale("logit_diff", [0.5]).color(0.5)
    assert hm.source.data["fill"][0] == color_scale("logit_diff", [0.5, -3.0]).color(0.5)


def test_box_selection_becomes_a_zoom_rectangle():
    hm = SweepHeatmap("post_block", [0, 2, 4], [0, 1, 2, 3], ["a", "b", "c", "d"], "recovered")
    assert hm.selected_block() is None
    hm.source.selected.indices = [1 * 4 + 1, 2 * 4 + 3]  # (layer 2, pos 1) and (layer 4, pos 3)
    assert hm.selected_block() == ([2, 3, 4], [1, 2, 3])  # every layer in between: finer than the sweep


def test_legend_explains_every_look():
    html = legend_html(noise_threshold=0.004)
    for status in CELL_LOOKS:
        assert legend_text(status, 0.004) in html
    assert "within noise floor (±0.004)" in html
    assert html.count("<svg") == len(CELL_LOOKS)


# ---- the tracing view, driven by its parameters -------------------------------------------------------
def test_tracing_view_shows_recorded_events():
    from app.dashboard.tracing.view import TracingView

    view = TracingView("http://127.0.0.1:9")  # never contacted: replay needs no server
    events = [start_event(hooks=("pre_attn", "post_block"), cells_total=24, token_strings=["<s>", "K<b>", " is", " ruled"],
                          answer_token="<i>"),
              {"type": "checksum", "consistent": True, "ranks": 1},
              cell(0, 1, 0.9, hook="pre_attn"), cell(2, 3, -0.4), cell(2, 3, None, error="voided: evicted"),
              {"type": "noise_floor", "value": 0.001}]
    state = view.replay(events)
    assert set(view.heatmaps) == {"pre_attn", "post_block"}
    pre = view.heatmaps["pre_attn"]
    assert pre.source.data["value"][0 * 4 + 1] == 0.9 and pre.labels[1] == "K<b>"
    post = view.heatmaps["post_block"].source.data
    assert math.isnan(post["value"][2 * 4 + 3]) and post["status_text"][2 * 4 + 3] == "voided — voided: evicted"
    html = view.status_html
    assert 'data-cb="checksum">consistent (1 rank)' in html and 'data-cb="noise-floor">0.001' in html
    assert 'data-done="2" data-total="24"' in html
    assert "answer “&lt;i&gt;”" in html and "<i>" not in html  # token text is escaped in HTML
    assert state.cells_voided == 1
    assert view.sweep_id == "sw-test" and view.result is state.result and view.progress == pytest.approx(2 / 24)
    assert view.phase == "idle" and view.export_hook == "pre_attn"
    # a summary replaces the shown sweep; exports get their names; a recorded kept run is never adopted
    view.replay([summary_event()])
    assert view.state.finished and view.status_html.count('data-final="1"') == 1 and view.phase == "done"
    assert view.kept_run is None and view.b_zoom.disabled
    assert all(not d.disabled for d in view.downloads)
    assert [d.filename for d in view.downloads][:4] == ["sweep-sw-test_post_block.pdf", "sweep-sw-test_post_block.svg",
                                                        "sweep-sw-test_post_block.png", "sweep-sw-test.csv"]


def test_controls_are_derived_from_the_parameters():
    from app.dashboard.tracing.view import TracingView

    view = TracingView("http://127.0.0.1:9")
    assert view.b_cancel.disabled and view.b_zoom.disabled and all(d.disabled for d in view.downloads)
    view.phase = "running"
    assert not view.b_cancel.disabled and view.b_zoom.disabled
    view.param.update(phase="done", kept_run="sweep-run1")
    assert view.b_cancel.disabled and not view.b_zoom.disabled
    # the corruption decides which fields show, and how the prompt field is labelled
    widgets = {getattr(w, "label", None): w for w in view.__panel__().select(pn.widgets.Widget)}
    assert widgets["Corrupt prompt"].visible and not widgets["Noise span (text in the prompt)"].visible
    view.corruption = NOISE_SPAN
    assert not widgets["Corrupt prompt"].visible and widgets["Noise span (text in the prompt)"].visible
    assert widgets["Noise samples"].visible and widgets["Clean prompt"].label == "Prompt (gets noise on the span)"
    # a form field typed in its widget is the parameter
    widgets["Cells in flight"].value = 3
    assert view.max_concurrency == 3 and view.form().max_concurrency == 3
    # offered hooks follow the server's
    view.set_hooks(["post_attn", "post_block"])
    assert list(widgets["Hooks"].options) == ["post_attn", "post_block"] and view.hooks == ["post_block"]
    # the selection on a heatmap is a parameter; zoom asks for one first
    view.replay([summary_event()])
    view.param.trigger("zoom_in")
    assert view.error.startswith("zoom: select cells first")
    view.heatmaps["post_block"].source.selected.indices = [0 * 4 + 1, 1 * 4 + 2]
    assert view.selection == ([0, 1], [1, 2])
    view.heatmaps["post_block"].source.selected.indices = []
    assert view.selection is None


def test_form_errors_are_shown_not_sent():
    from app.dashboard.tracing.view import TracingView

    assert TracingView("http://127.0.0.1:9", layers="0-3", hooks=["pre_attn"]).form().layers == "0-3"  # over the default form
    view = TracingView("http://127.0.0.1:9")
    view.layers = "3-1"
    view.param.trigger("run_sweep")
    assert view.error.startswith("layers:")
    assert view.phase == "idle" and not view.running


# ---- one client factory ---------------------------------------------------------------------------
def test_both_views_get_their_client_from_one_factory(monkeypatch):
    from app.client import AsyncCausalboardClient, CausalboardClient
    from app.client.factory import async_client
    from app.dashboard.steering.view import SteeringView
    from app.dashboard.tracing.view import TracingView

    monkeypatch.setenv("CAUSALBOARD_URL", "http://cb.example:8123")
    monkeypatch.setenv("CAUSALBOARD_API_KEY", "the-servers-own-key")  # never picked up by a page
    tracing, steering = TracingView(), SteeringView(autostart=False)
    for view in (tracing, steering):
        assert view.client.base_url == "http://cb.example:8123" and view._owns_client
        assert "authorization" not in view.client._http.headers
    keyed = TracingView("http://h:1", api_key="k1")
    assert keyed.client._http.headers["authorization"] == "Bearer k1"
    with CausalboardClient("http://h:2", api_key="k2") as sync:
        client, owned = async_client(sync)
        assert (client.base_url, client._http.headers["authorization"], owned) == ("http://h:2", "Bearer k2", True)
    given = AsyncCausalboardClient("http://h:3")
    assert async_client(given) == (given, False) and TracingView(given)._owns_client is False
    with pytest.raises(TypeError):
        async_client(3)


# ---- export names match app.figures.export ---------------------------------------------------------------
def test_download_names_and_bytes_match_the_export_manifest(tmp_path):
    from app.figures import export
    from app.dashboard.tracing.downloads import EXPORTS, export_filename, export_payload

    result = SweepResult.from_summary({k: v for k, v in summary_event().items() if k != "type"})
    stem = "sweep-sw-test"
    manifest = export.export_sweep(result, tmp_path, stem=stem)
    written = {p.name for p in tmp_path.iterdir()}
    for _label, fmt in EXPORTS:
        if fmt != "zip":
            assert export_filename(stem, fmt, "post_block") in written, fmt
    csv_bytes = export_payload(result, "csv", "post_block", stem)
    assert manifest["files"][f"{stem}.csv"]["sha256"] == hashlib.sha256(csv_bytes).hexdigest()
    shown = json.loads(export_payload(result, "manifest", "post_block", stem))
    assert shown["files"][f"{stem}.csv"]["sha256"] == hashlib.sha256(csv_bytes).hexdigest()
    assert export_payload(result, "png", "post_block", stem)[:8] == b"\x89PNG\r\n\x1a\n"


# ---- mounting ---------------------------------------------------------------------------------------
def test_mount_serves_the_page_offline_and_keeps_api_routes():
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from app.dashboard import mount

    app = FastAPI()

    @app.get("/v1/ping")
    def ping() -> dict:
        return {"ok": True}

    mount(app)
    with TestClient(app) as client:
        assert client.get("/v1/ping").json() == {"ok": True}
        assert client.get("/v1/nothing").status_code == 404
        page = client.get("/dashboard")
        assert page.status_code == 200 and "text/html" in page.headers["content-type"]
        scripts = re.findall(r'<script[^>]+src="([^"]+)"', page.text)
        assert any("bokeh" in s for s in scripts)
        for src in scripts:  # every script comes from this server: the page works offline
            assert not src.startswith(("http://", "https://", "//")), src
        # (the browser test checks that every resource the page loads answers 200)
        bokeh_js = next(s for s in scripts if re.search(r"bokeh(-[\d.]+)?(\.min)?\.js", s))
        assert client.get(urljoin("http://testserver/dashboard", bokeh_js)).status_code == 200


def test_session_api_url_prefers_the_configured_url():
    from fastapi import FastAPI

    from app.dashboard import session_api_url

    app = FastAPI()
    app.state.dashboard_api_url = "http://api.internal:9000/"
    assert session_api_url(app) == "http://api.internal:9000"


def test_uvicorn_can_serve_the_dashboard_websocket():
    """The page talks to its session over a WebSocket; uvicorn serves WebSockets only with the
    `websockets` or `wsproto` package installed."""
    from app.dashboard import websocket_library

    assert websocket_library() is not None, (
        "uvicorn has no WebSocket library (websockets or wsproto): /dashboard cannot connect; "
        "add one to requirements/cpu.txt and requirements/gpu.txt")


# ---- the page shell ----------------------------------------------------------------------------------
def test_header_shows_model_device_and_versions_escaped():
    from app.dashboard.app import header_html

    html = header_html({"status": "ok", "model": "tiny<script>", "architecture": "LlamaForCausalLM", "num_layers": 6,
                        "device": "cpu", "dtype": "float32", "versions": {"torch": "2.11", "vllm": "0.25.1", "causalboard": "0.1.0"}},
                       "http://127.0.0.1:8000")
    assert 'data-cb="model">tiny&lt;script&gt;</b>' in html and 'data-cb="device">cpu</b>' in html
    assert html.index("causalboard 0.1.0") < html.index("vllm 0.25.1") < html.index("torch 2.11")
    down = header_html(None, "http://x:1", "ConnectError: refused")
    assert "unreachable" in down and "ConnectError" in down


def test_page_asks_for_the_api_key_before_building_the_views():
    import panel as pn

    from app.dashboard.app import create_page

    page = create_page("http://127.0.0.1:9", ask_api_key=True)
    assert page.tracing is None and isinstance(page.key_input, pn.widgets.PasswordInput)
    connect = page.body[0][1]
    connect.clicks += 1  # no key yet: nothing happens
    assert page.tracing is None and page.tabs is None
    page.key_input.value = "s3cret"
    connect.clicks += 1
    assert page.body[0] is page.tabs and page.tabs._names == ["Causal tracing", "Steering"]
    assert page.tracing.client._http.headers["authorization"] == "Bearer s3cret"
    assert page.steering.client._http.headers["authorization"] == "Bearer s3cret"
    assert "unreachable" in page.header.object  # the status request failed (nothing listens on port 9)


def test_create_app_without_the_dashboard_never_imports_panel():
    """`create_app(dashboard=False)` (`causalboard serve --no-dashboard`): the API alone, for an
    environment without Panel (a GPU host's engine-only bundle). Run in a fresh interpreter where
    importing `panel` fails, as it does there; with the dashboard that import is needed."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys; sys.modules['panel'] = None\n"  # `import panel` raises ImportError from here on
            "from app.api.app import create_app\n"
            "app = create_app(dashboard=False)\n"
            "paths = {getattr(r, 'path', '') for r in app.routes}\n"
            "assert '/v1/status' in paths and not any(p.startswith('/dashboard') for p in paths), sorted(paths)\n"
            "try:\n"
            "    create_app()\n"
            "except ImportError as exc:\n"
            "    print('needs panel:', exc)\n")
    repo = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=repo,
                          env={**os.environ, "PYTHONPATH": str(repo)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "needs panel:" in proc.stdout, proc.stdout


def test_cli_serve_has_no_dashboard_flag():
    from app.cli.main import build_parser

    args = build_parser().parse_args(["serve", "--no-dashboard"])
    assert args.dashboard is False
    assert build_parser().parse_args(["serve"]).dashboard is True

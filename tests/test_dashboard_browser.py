"""The causal-tracing dashboard in a real browser (Chromium via Playwright) against the real API
and engine (`server_url`: uvicorn on the shared CPU vLLM engine, the dashboard mounted at
/dashboard). Screenshots go to `<out>/screenshots/dashboard-*.png`.

What is checked is what the browser really shows: the Bokeh data sources inside the page (not
the server's Python objects), the status text, downloads — and the API's own view of each sweep
(`GET /v1/patch_sweep/{id}`) to confirm the page's numbers and that Cancel really cancelled.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import math
import time

import pytest

pytest_plugins = ["tests.browser"]
pytest.register_assert_rewrite("tests.browser")

from tests.browser import _tab_close_cleanup_s, bokeh_columns, bokeh_figures, choose, drag, screenshot, wait_until  # noqa: E402
pytestmark = pytest.mark.browser

SWEEP_TIMEOUT = 120.0


def open_dashboard(page, server_url: str, status: dict) -> None:
    page.goto(f"{server_url}/dashboard")
    page.get_by_role("button", name="Run sweep").wait_for()
    # the header is filled from GET /v1/status once the session has loaded
    page.locator('[data-cb="model"]', has_text=status["model"]).wait_for()
    assert page.locator('[data-cb="device"]').inner_text() == status["device"]
    assert f"vllm {status['versions']['vllm']}" in page.locator('[data-cb="versions"]').inner_text()


def shown_cells(page) -> dict[str, list[dict]]:
    """hook -> the cells of that hook's heatmap as the browser holds them."""
    out: dict[str, list[dict]] = {}
    for cols in bokeh_columns(page, "status_text"):
        hook = cols["hook"][0] if cols["hook"] else None
        out[hook] = [{k: cols[k][i] for k in ("layer", "position", "value", "status_text")} for i in range(len(cols["layer"]))]
    return out


def filled(page) -> int:
    return sum(1 for cells in shown_cells(page).values() for c in cells if c["value"] is not None)


def phase(page) -> str:
    loc = page.locator('[data-cb="phase"]')
    return loc.first.inner_text() if loc.count() else ""


def progress(page) -> tuple[int, int]:
    loc = page.locator('[data-cb="progress"]')
    if not loc.count():
        return 0, 0
    return int(loc.get_attribute("data-done")), int(loc.get_attribute("data-total"))


def sweep_id(page) -> str:
    return page.locator('[data-cb="sweep-id"]').inner_text()


def cell_center(fig: dict, n_layers: int, n_positions: int, layer_index: int, position_index: int,
                dx: float = 0.0, dy: float = 0.0) -> tuple[float, float]:
    """Page pixels of a cell's centre (layers bottom-up, positions left to right), moved by
    `dx` cell widths to the right and `dy` cell heights up."""
    cw, ch = fig["w"] / n_positions, fig["h"] / n_layers
    return fig["x"] + (position_index + 0.5 + dx) * cw, fig["y"] + (n_layers - 1 - layer_index + 0.5 - dy) * ch


def server_summary(http, sid: str) -> dict:
    return wait_until(lambda: (lambda s: s if "layers" in s else None)(http.get(f"/v1/patch_sweep/{sid}").json()),
                      timeout=30, message=f"the summary of {sid}")


def test_sweep_fills_live_then_zoom_export_and_replace(page, server_url, http, tasks):
    status = http.get("/v1/status").json()
    open_dashboard(page, server_url, status)
    pair = next(p for p in tasks["pairs"] if p["equal_length"] and p.get("hf_top1", True))
    assert page.get_by_label("Clean prompt", exact=True).input_value() == pair["clean_prompt"]  # defaults: a real fact pair
    screenshot(page, "dashboard-idle")

    # ---- a sweep with the defaults: cells arrive in the browser, status ends "finished"
    page.get_by_role("button", name="Run sweep").click()
    seen = []
    deadline = time.monotonic() + SWEEP_TIMEOUT
    while phase(page) != "finished":
        assert time.monotonic() < deadline, f"sweep did not finish (phase {phase(page)!r})"
        seen.append(filled(page))
        time.sleep(0.05)
    done, total = progress(page)
    n_layers = status["num_layers"]
    n_tokens = http.post("/v1/tokenize", json={"prompt": pair["corrupt_prompt"]}).json()["count"]
    assert total == n_layers * n_tokens == done  # one hook (post_block) x all layers x all positions
    assert filled(page) == total
    assert seen == sorted(seen), "the number of filled cells went down"
    sid = sweep_id(page)
    summary = server_summary(http, sid)
    assert not summary["cancelled"] and summary["cells_done"] == total

    # the numbers the browser shows are the API's
    cells = shown_cells(page)["post_block"]
    grid = summary["grid"]
    for c in cells:
        want = grid[summary["layers"].index(c["layer"])][summary["positions"].index(c["position"])]
        assert math.isclose(c["value"], want, rel_tol=1e-12, abs_tol=1e-12), (c, want)
    # noise floor and checksum are shown
    nf = page.locator('[data-cb="noise-floor"]').inner_text()
    assert math.isclose(float(nf), summary["noise_floor"], rel_tol=1e-3, abs_tol=1e-12)
    assert page.locator('[data-cb="checksum"]').inner_text().startswith("consistent")
    assert summary["checksum"]["consistent"] is True
    assert "prefix 1" in page.locator('[data-cb="alignment"]').inner_text()
    # hover shows the exact value of a cell
    fig = bokeh_figures(page)[0]
    assert fig["title"].startswith("post_block")
    page.mouse.move(*cell_center(fig, n_layers, n_tokens, 0, 1))
    page.get_by_text("status:").first.wait_for()
    assert page.get_by_text("value:").first.is_visible()
    screenshot(page, "dashboard-sweep-finished")
    assert summary["subject_positions"] == [1]  # the default pair's subject, marked * on the axis
    kept = summary["captured_source_run"]
    assert summary["source_kept"] and kept in runs_in_store(http)

    # ---- zoom: drag a box over layers 1-3 x positions 1-3, re-sweep it from the kept clean run
    # Bokeh's box select takes the cells whose centre is inside the box: start and end a little
    # beyond the corner cells' centres
    drag(page, cell_center(fig, n_layers, n_tokens, 1, 1, -0.3, -0.3), cell_center(fig, n_layers, n_tokens, 3, 3, 0.3, 0.3))
    zoom = page.get_by_role("button", name="Zoom into selection")
    wait_until(lambda: zoom.is_enabled(), timeout=10, message="the zoom button")
    time.sleep(0.5)  # the selection reaches the server with the next websocket message
    zoom.click()
    wait_until(lambda: sweep_id(page) != sid and phase(page) == "finished", timeout=SWEEP_TIMEOUT, message="the zoom sweep")
    zsum = server_summary(http, sweep_id(page))
    assert zsum["layers"] == [1, 2, 3] and zsum["positions"] == [1, 2, 3]
    assert zsum["source"]["run_id"] == kept and not zsum["auto_captured"]  # reused, not re-captured
    assert filled(page) == 9
    assert any("zoom" in f["title"] for f in bokeh_figures(page))
    page.mouse.move(5, 5)  # no tooltip over the picture
    screenshot(page, "dashboard-zoom")

    # ---- export: the CSV matches the summary; the manifest lists the downloaded CSV's checksum
    with page.expect_download() as dl:
        page.get_by_role("button", name="CSV").click()
    csv_bytes = read_download(dl.value)
    rows = list(csv.DictReader(io.StringIO(csv_bytes.decode())))
    assert len(rows) == 9 and {r["status"] for r in rows} <= {"ok", "within_noise"}
    assert dl.value.suggested_filename == f"sweep-{zsum['sweep_id']}.csv"
    with page.expect_download() as dl:
        page.get_by_role("button", name="Manifest JSON").click()
    manifest = json.loads(read_download(dl.value))
    assert manifest["files"][f"sweep-{zsum['sweep_id']}.csv"]["sha256"] == hashlib.sha256(csv_bytes).hexdigest()
    with page.expect_download() as dl:
        page.get_by_role("button", name="PNG").click()
    assert read_download(dl.value)[:8] == b"\x89PNG\r\n\x1a\n"

    # ---- a new (non-zoom) sweep drops the kept clean run first
    page.get_by_role("button", name="Run sweep").click()
    wait_until(lambda: sweep_id(page) not in (sid, zsum["sweep_id"]) and phase(page) == "finished",
               timeout=SWEEP_TIMEOUT, message="the replacing sweep")
    assert kept not in runs_in_store(http)
    last_kept = server_summary(http, sweep_id(page))["captured_source_run"]
    assert last_kept in runs_in_store(http)
    assert not page.cb_errors, page.cb_errors

    # ---- closing the tab ends its session, which drops the run it kept for zooms
    page.context.close()
    wait_until(lambda: last_kept not in runs_in_store(http), timeout=_tab_close_cleanup_s(),
               message="the closed tab's kept run to be dropped")


def running_sweep(http, min_cells: int = 0, other_than: str | None = None) -> dict | None:
    """The server's one running sweep (not `other_than`) once it has `min_cells` done, else None."""
    active = [s for s in http.get("/v1/status").json()["sweeps"]["sweeps"]
              if s["sweep_id"] != other_than and s["state"] == "running"]
    return active[0] if len(active) == 1 and active[0]["cells_done"] >= min_cells else None


#: noise draws per cell of the cancel test's sweeps: each cell is this many engine requests
NOISE_SAMPLES = 32


def test_cancel_and_replace_stop_running_sweeps(page, server_url, http):
    status = http.get("/v1/status").json()
    open_dashboard(page, server_url, status)
    # a sweep that cannot finish before a click reaches the server, by construction: noise
    # corruption with NOISE_SAMPLES draws (every cell is that many engine requests), every hook,
    # one cell in flight, a long prompt: ~20 000 engine requests, minutes even on a fast engine.
    # The test cancels it after a few cells, so it costs a few cells' time when it passes. On a
    # loaded 2-core machine the browser (and Playwright's calls into it) can lag the server by many
    # seconds while the engine runs, and the engine's speed varies several-fold, so the test
    # times its clicks by what the server says is running, never by what the page shows
    prompt = page.get_by_label("Prompt (gets noise on the span)", exact=True)
    choose(page, "noise on a span", prompt, other="corrupt prompt")
    for hook in ("pre_attn", "post_attn"):
        page.get_by_role("button", name=hook).click()
    filler = " ".join(["The capital of Tarn is Tibbet"] * 5)
    prompt.fill(f"{filler} {prompt.input_value()}")
    prompt.press("Tab")
    for label, value in (("Noise samples", NOISE_SAMPLES), ("Cells in flight", 1)):
        box = page.get_by_label(label)
        box.fill(str(value))
        box.press("Enter")
    time.sleep(0.3)
    assert running_sweep(http) is None

    # ---- starting a new sweep cancels the running one
    page.get_by_role("button", name="Run sweep").click()
    first = wait_until(lambda: running_sweep(http, min_cells=2), timeout=SWEEP_TIMEOUT, message="the first sweep's first cells")["sweep_id"]
    page.get_by_role("button", name="Run sweep").click()
    second = wait_until(lambda: running_sweep(http, other_than=first), timeout=SWEEP_TIMEOUT, message="the second sweep's start")["sweep_id"]
    replaced = server_summary(http, first)
    assert replaced["noise"]["samples"] == NOISE_SAMPLES and len(replaced["hooks"]) == 3
    assert replaced["cells_total"] * NOISE_SAMPLES > 15_000  # long by construction
    assert replaced["cancelled"] is True and replaced["cells_done"] < replaced["cells_total"], replaced["notes"]
    wait_until(lambda: page.locator('[data-cb="sweep-id"]').count() and sweep_id(page) == second,
               timeout=SWEEP_TIMEOUT, message="the page to show the second sweep")

    # ---- Cancel: after Cancel nothing more arrives and the API says cancelled
    wait_until(lambda: running_sweep(http, min_cells=3), timeout=SWEEP_TIMEOUT, message="the second sweep's cells")
    # the pointer rests on "Run sweep": its hover text must not cover Cancel beside it (Panel's
    # default placed it there, interactive, and a pointer moving to Cancel landed on the text)
    page.get_by_role("button", name="Run sweep").hover()
    time.sleep(1.0)  # the text shows after 500 ms
    cancel = page.get_by_role("button", name="Cancel").bounding_box()
    on_top = page.evaluate("([x, y]) => document.elementFromPoint(x, y)?.outerHTML.slice(0, 200) ?? ''",
                           [cancel["x"] + cancel["width"] / 2, cancel["y"] + cancel["height"] / 2])
    assert "bk-Tooltip" not in on_top, f"a tooltip covers Cancel: {on_top}"
    page.get_by_role("button", name="Cancel").click()
    summary = server_summary(http, second)
    assert summary["cancelled"] is True and 3 <= summary["cells_done"] < summary["cells_total"]
    page.locator('[data-cb="phase"]', has_text="cancelled").wait_for(timeout=SWEEP_TIMEOUT * 1000)
    assert sweep_id(page) == second
    # the page then shows the server's final (cancelled) summary — including the cells that were
    # in flight when the stream closed — and nothing arrives after it. The heatmap patches may
    # reach the browser a moment after the status text, so wait for them rather than read once.
    page.locator('[data-cb="progress"][data-final="1"]').wait_for(timeout=SWEEP_TIMEOUT * 1000)
    final_cells = summary["cells_done"] - summary["cells_voided"]
    wait_until(lambda: filled(page) == final_cells, timeout=30, message=f"the heatmaps to show the summary's {final_cells} cells")
    assert 0 < final_cells < progress(page)[1]  # a partly filled grid
    time.sleep(2.0)
    assert filled(page) == final_cells
    assert server_summary(http, second)["cells_done"] == summary["cells_done"]
    assert page.get_by_role("button", name="Cancel").is_disabled()
    assert len(bokeh_figures(page)) == 3  # one heatmap per hook
    page.mouse.move(5, 5)
    screenshot(page, "dashboard-cancelled")
    assert not page.cb_errors, page.cb_errors


def test_noise_corruption_of_the_subject_span(page, server_url, http, tasks):
    status = http.get("/v1/status").json()
    open_dashboard(page, server_url, status)
    span = page.get_by_label("Noise span (text in the prompt)")
    choose(page, "noise on a span", span, other="corrupt prompt")
    assert not page.get_by_label("Corrupt prompt", exact=True).is_visible()
    pair = next(p for p in tasks["pairs"] if p["equal_length"] and p.get("hf_top1", True))
    assert span.input_value() == pair["subject_clean"]
    page.get_by_role("button", name="Run sweep").click()
    wait_until(lambda: phase(page) == "finished", timeout=SWEEP_TIMEOUT, message="the noise sweep")
    summary = server_summary(http, sweep_id(page))
    assert summary["prompt"] == pair["clean_prompt"] and summary["noise"]["scale"] == 3.0
    noised = summary["noise"]["positions"]
    assert noised and f"noise on positions {', '.join(map(str, noised))}" in page.locator('[data-cb="alignment"]').inner_text()
    done, total = progress(page)
    assert done == total == summary["cells_total"] and filled(page) == total
    page.mouse.move(5, 5)
    screenshot(page, "dashboard-noise")
    assert not page.cb_errors, page.cb_errors


def runs_in_store(http) -> list[str]:
    return [r["run_id"] for r in http.get("/v1/status").json()["source_store"]["runs"]]


def read_download(download) -> bytes:
    with open(download.path(), "rb") as fh:
        return fh.read()


def test_the_view_alone_under_panel_serve(page, server_url, http):
    """The same `TracingView` under `panel serve` (Panel's own Tornado server, no FastAPI): a
    sweep streams and finishes, and closing the tab ends the session, which drops its kept run."""
    import socket

    import panel as pn

    from app.dashboard import CHECK_UNUSED_SESSIONS_MS, UNUSED_SESSION_LIFETIME_MS
    from app.dashboard.tracing.view import TracingView

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = pn.serve({"tracing": lambda: TracingView(server_url, layers="0-1")}, port=port, address="127.0.0.1",
                      threaded=True, show=False, websocket_origin=[f"127.0.0.1:{port}"],
                      unused_session_lifetime_milliseconds=UNUSED_SESSION_LIFETIME_MS,
                      check_unused_sessions_milliseconds=CHECK_UNUSED_SESSIONS_MS)
    try:
        def port_open() -> bool:
            with socket.socket() as s:
                return s.connect_ex(("127.0.0.1", port)) == 0

        wait_until(port_open, timeout=30, message="the panel server")
        page.goto(f"http://127.0.0.1:{port}/tracing")
        page.get_by_role("button", name="Run sweep").click()
        wait_until(lambda: phase(page) == "finished", timeout=SWEEP_TIMEOUT, message="the sweep under panel serve")
        summary = server_summary(http, sweep_id(page))
        assert summary["layers"] == [0, 1] and not summary["cancelled"]
        wait_until(lambda: filled(page) == summary["cells_done"], timeout=30, message="the heatmap's cells")
        kept = summary["captured_source_run"]
        assert summary["source_kept"] and kept in runs_in_store(http)
        assert not page.cb_errors, page.cb_errors
        page.context.close()
        wait_until(lambda: kept not in runs_in_store(http), timeout=_tab_close_cleanup_s(),
                   message="the closed tab's kept run to be dropped")
    finally:
        server.stop()

"""The notebooks in JupyterLab, in a real browser: `scripts/lab.sh` (what `make lab` runs) on a free
loopback port with a token, over temporary COPIES of notebooks/ (outputs cleared), their kernels
pointed at the test server (`server_url`) through `CAUSALBOARD_URL`. Each test opens a notebook
through the UI, runs Run > Run All Cells, waits for the kernel to go idle, saves it through the
UI and asserts on what the browser rendered and on the saved file. Screenshots go to
`<out>/screenshots/jupyterlab-*.png` (copies of them are docs/img/jupyterlab-*.png).

Harness: tests/jupyterlab.py. What the rendered notebook shows is read from the page (Playwright
locators reach into Bokeh's shadow DOM; `bokeh_columns` reads the browser-side heatmap data).
"""

from __future__ import annotations

import csv
import re

import pytest

pytest_plugins = ["tests.browser", "tests.jupyterlab"]
pytest.register_assert_rewrite("tests.browser", "tests.jupyterlab")

from tests.browser import bokeh_columns, bokeh_figures, screenshot, wait_until  # noqa: E402
from tests.jupyterlab import stderr_of, stdout_of  # noqa: E402

pytestmark = pytest.mark.browser

#: Panel's `pn.extension()` in a notebook adds panel.min.js twice; the browser aborts the duplicate
BENIGN = re.compile(r"request failed: .*/panel\.min\.js \(net::ERR_ABORTED\)")
VECTOR = "capital_minus_language"  # registered by notebook 02


def page_errors(page) -> list[str]:
    return [e for e in page.cb_errors if not BENIGN.fullmatch(e)]


def ran_cleanly(nb, prompts: list[str]) -> str:
    """Every code cell ran once, in order, in a fresh kernel, without an error output; the saved
    notebook's stdout (connect() found the test server, not another one)."""
    saved = nb.save()
    n_code = sum(c.cell_type == "code" for c in saved.cells)
    assert not nb.error_outputs(saved), nb.error_outputs(saved)
    assert prompts == [f"[{i}]:" for i in range(1, n_code + 1)]
    out = stdout_of(saved)
    assert f"connected to {nb.lab.server_url}: causalboard-tiny (" in out
    return out


def test_01_causal_tracing_runs_and_shows_its_figures(jupyterlab, page, http):
    nb = jupyterlab.open(page, "01_causal_tracing.ipynb")
    try:
        out = ran_cleanly(nb, nb.run_all())
        assert len(re.findall(r"^TOP  ", out, re.M)) == 6 and "checksum consistent: True" in out

        # the three matplotlib figures (the pair sweep's post_block, the noise sweep, the average
        # trace by token role), decoded by the browser
        images = nb.panel.locator('.jp-OutputArea-output[data-mime-type="image/png"] img')
        assert images.count() == 3
        for i in range(3):
            images.nth(i).scroll_into_view_if_needed()
            assert images.nth(i).evaluate("img => img.complete && img.naturalWidth > 300 && img.naturalHeight > 150")

        # the sweep's progress bar (one HTML output, updated in place) ended finished, and the
        # SweepResult displays as its heatmaps, decoded by the browser
        bar = nb.panel.locator('[data-cb="sweep-progress"]')
        assert bar.count() == 1 and bar.get_attribute("data-state") == "done"
        assert bar.get_attribute("data-done") == bar.get_attribute("data-total") != "0"
        shown = nb.panel.locator('[data-cb="sweep-result"] [data-cb="heatmap"] img')
        assert shown.count() == 2
        for i in range(2):
            shown.nth(i).scroll_into_view_if_needed()
            assert shown.nth(i).evaluate("img => img.complete && img.naturalWidth > 300 && img.naturalHeight > 150")

        # the live TracingView, rendered by Panel/Bokeh in the output: its heatmap, as the browser
        # holds it, has every cell of the sweep the next cell ran from code
        finished = re.search(r"dashboard sweep finished: True, cells done (\d+)", out)
        assert finished, ([line for line in out.splitlines() if line.startswith("dashboard ")],
                          stderr_of(nb.save())[-3000:])
        done = int(finished.group(1))
        view = nb.cell("TracingView(URL)").locator(".jp-OutputArea")
        view.get_by_role("button", name="Run sweep").scroll_into_view_if_needed()
        figures = [f for f in bokeh_figures(page) if f["title"].endswith("clean → corrupt")]  # presentation.figure_title
        assert figures and all(f["w"] > 100 and f["h"] > 100 for f in figures)

        def heatmap_values() -> list:
            return [v for cols in bokeh_columns(page, "status_text") for v in cols["value"]]

        status = view.locator('[data-cb="progress"]')
        wait_until(lambda: len(heatmap_values()) == done and None not in heatmap_values(), timeout=60,
                   message=f"the view's heatmap to hold the {done} cells of its sweep")
        # the status block, as the browser shows it: the finished sweep with all its cells
        wait_until(lambda: status.count() == 1 and status.get_attribute("data-final") == "1", timeout=60,
                   message="the view's status block to show the finished sweep")
        assert status.get_attribute("data-done") == str(done) == status.get_attribute("data-total")
        assert view.locator('[data-cb="phase"]').inner_text() == "finished"
        sweep_id = view.locator('[data-cb="sweep-id"]').inner_text()
        assert nb.kernel_exec("print(tracing.sweep_id)") == f"{sweep_id}\n"
        screenshot(page, "jupyterlab-01-tracing", full_page=False)

        # an export button of the view, clicked in the browser: the kernel builds the file and the
        # browser downloads it (the CSV of the shown sweep, one row per cell)
        with page.expect_download(timeout=60_000) as dl:
            view.get_by_role("button", name="CSV").click()
        assert dl.value.suggested_filename == f"sweep-{sweep_id}.csv"
        with open(dl.value.path(), encoding="utf-8") as fh:
            rows = list(csv.DictReader(fh))
        assert len(rows) == done and {r["status"] for r in rows} <= {"ok", "within_noise"}
        assert not page_errors(page), page_errors(page)
    finally:
        nb.shutdown()


def test_02_steering_slider_moved_in_the_browser_regenerates(jupyterlab, page, http):
    nb = jupyterlab.open(page, "02_steering_sliders.ipynb")
    try:
        out = ran_cleanly(nb, nb.run_all())
        assert re.search(r"STEERING CHANGED [123] of 3", out)
        prompt = re.search(r"^prompt:   '(.*)'$", out, re.M).group(1)
        baseline = re.search(r"^baseline: '(.*)'$", out, re.M).group(1)
        steered = re.search(r"^steered:  '(.*)'  \(", out, re.M).group(1)
        assert baseline != steered

        # the SteeringView, rendered by Panel/Bokeh in the output, shows what the kernel printed:
        # the vector selected with its scale slider at +1.50, the baseline and the steered text
        view = nb.cell("SteeringView(URL)").locator(".jp-OutputArea")
        view.locator('[data-cb="steered-text"]').first.scroll_into_view_if_needed()
        slider = view.locator(".cb-scale-slider")
        title = slider.locator(".bk-slider-title")
        assert slider.count() == 1 and slider.locator(".noUi-handle").first.is_visible()

        def shown(kind: str) -> str:
            return view.locator(f'[data-cb="{kind}-text"]').first.inner_text().strip()

        def status() -> str:
            return view.locator('[data-cb="steered-status"]').first.inner_text()

        wait_until(lambda: " ".join(title.inner_text().split()) == f"scale · {VECTOR}: 1.50" and shown("steered") == steered.strip(),
                   timeout=30, message="the view to show the kernel's slider and steered text")
        assert view.locator('[data-cb="baseline-prompt"]').first.inner_text() == view.locator('[data-cb="steered-prompt"]').first.inner_text()
        assert shown("baseline") == baseline.strip()

        # move the slider in the browser (keyboard, 0.1 a step): 1.50 -> 0.50. The kernel hears
        # the move over the comm, re-runs the steered stream, and the new text reaches the page;
        # it is the server's generation at scale 0.5, and the baseline stays
        handle = slider.locator(".noUi-handle").first

        def press_down_to(target: float) -> None:
            """ArrowLeft on the focused handle, one step (0.1) at a time, each seen by the slider."""
            handle.focus()
            value = float(title.inner_text().split(":")[-1])
            while value > target + 1e-9:
                page.keyboard.press("ArrowLeft")
                value = round(value - 0.1, 6)
                wait_until(lambda: abs(float(title.inner_text().split(":")[-1]) - value) < 1e-6, timeout=10,
                           message=f"the slider to read {value:.2f}")

        press_down_to(0.5)
        wait_until(lambda: "× +0.50" in status() and status().startswith("done"), timeout=120,
                   message="the steered stream at scale 0.5")
        # the kernel's view heard every key press (the last one included)
        assert nb.kernel_exec("print(float(round(control.scale, 6)), view.steered_text == view.baseline_text)") == "0.5 False\n"
        expected = http.post("/v1/generate", json={"prompt": prompt, "max_tokens": 16, "interventions": {"steer": [
            {"sites": ["L2.post_block"], "name": VECTOR, "scale": 0.5}]}}).json()["text"]
        assert shown("steered") == expected.strip() and expected.strip() != steered.strip()
        assert shown("baseline") == baseline.strip()
        screenshot(page, "jupyterlab-02-steering", full_page=False)

        assert not page_errors(page), page_errors(page)
    finally:
        nb.shutdown()
        http.delete(f"/v1/steering/vectors/{VECTOR}")

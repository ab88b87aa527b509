"""The dashboard's Steering tab in a real browser (Chromium via Playwright) against the real API and
engine: build a contrastive vector with the form, move its scale slider with the keyboard, and
see the steered generation change while the baseline stays. Screenshots go to
`<out>/screenshots/steering-*.png`.

The page is the dashboard's own (`app.dashboard.app.create_page`), opened at `<server_url>/dashboard`
where the API process serves it. That needs a websocket library for uvicorn (`websockets` or
`wsproto`); without one the same page is served by Panel's Tornado server on another port,
talking to the same API (the reason is printed), so the steering view is still tested in a
browser.
"""

from __future__ import annotations

import socket
import time

import pytest

from tests.browser import VIEWPORT, screenshot, wait_until

pytest_plugins = ["tests.browser"]
pytestmark = pytest.mark.browser


@pytest.fixture
def dashboard_url(server_url):
    """URL of the dashboard page for the test server's API."""
    from app.dashboard import websocket_library

    if websocket_library() is not None:
        yield f"{server_url}/dashboard"
        return
    import panel as pn

    from app.dashboard.app import create_page

    print("uvicorn has no websocket library (websockets/wsproto): serving the dashboard page with Panel's Tornado server")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = pn.serve({"dashboard": lambda: create_page(server_url)}, port=port, address="127.0.0.1", threaded=True,
                      show=False, websocket_origin=[f"127.0.0.1:{port}"])
    wait_until(lambda: getattr(server, "_started", True) and _port_open(port), timeout=30, message="the panel server")
    try:
        yield f"http://127.0.0.1:{port}/dashboard"
    finally:
        server.stop()


@pytest.fixture
def steering_page(browser, request):
    """A fresh page (as `tests.browser.page`, which refuses to run without a websocket library:
    this test has the Tornado fallback above); a screenshot is saved when the test fails."""
    context = browser.new_context(viewport=VIEWPORT)
    context.set_default_timeout(30_000)
    pg = context.new_page()
    pg.cb_errors = []
    pg.on("pageerror", lambda exc: pg.cb_errors.append(str(exc)))
    try:
        yield pg
    finally:
        rep = getattr(request.node, "cb_rep_call", None)
        if rep is not None and rep.failed:
            screenshot(pg, f"FAILED-{request.node.name}")
        context.close()


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _text(page, kind: str) -> str:
    return page.locator(f'[data-cb="{kind}-text"]').first.inner_text()


def _status(page, kind: str) -> str:
    return page.locator(f'[data-cb="{kind}-status"]').first.inner_text()


def test_scale_slider_changes_the_steered_text_only(steering_page, dashboard_url, server_url, tasks):
    from app.client import CausalboardClient
    from app.dashboard.steering.vectors import contrast_defaults

    page = steering_page
    d = contrast_defaults(tasks)
    with CausalboardClient(server_url) as client:
        client.delete_vector(d.name)  # start from a server without the vector
        expected_baseline = client.generate(d.test_prompt, max_tokens=16)["text"]
    try:
        page.goto(dashboard_url)
        page.get_by_text("Steering", exact=True).first.click()  # the tab header
        # both columns stream on load; nothing is selected, so the steered column is the baseline
        wait_until(lambda: _status(page, "baseline").startswith("done") and _status(page, "steered").startswith("done"),
                   timeout=60, message="the first generations")
        assert page.locator('[data-cb="baseline-prompt"]').first.inner_text() == d.test_prompt
        assert _text(page, "baseline") == expected_baseline
        assert _text(page, "steered") == expected_baseline
        screenshot(page, "steering-1-loaded")

        page.get_by_role("button", name="Capture & register").click()
        wait_until(lambda: "registered" in page.locator('[data-cb="build-status"]').first.inner_text(), timeout=60,
                   message="the vector to be captured and registered")
        slider = page.locator(".cb-scale-slider .noUi-handle").first
        slider.wait_for()
        screenshot(page, "steering-2-vector-built")

        # keyboard moves, 0.1 each: 15 quick steps (debounced into few streams) to +1.50
        slider.focus()
        for _ in range(15):
            page.keyboard.press("ArrowRight")
        wait_until(lambda: "× +1.50" in _status(page, "steered") and _status(page, "steered").startswith("done"),
                   timeout=60, message="the steered stream at scale 1.5")
        steered = _text(page, "steered")
        with CausalboardClient(server_url) as client:
            expected_steered = client.generate(d.test_prompt, max_tokens=16, interventions={"steer": [
                {"sites": [f"L{d.layer}.{d.hook}"], "name": d.name, "scale": 1.5}]})["text"]
        assert steered == expected_steered
        assert steered != expected_baseline
        assert _text(page, "baseline") == expected_baseline  # the baseline stays
        assert "|v| = " in _status(page, "steered")
        screenshot(page, "steering-3-steered")

        # back to 0: the steered column is the baseline again
        slider.focus()
        for _ in range(15):
            page.keyboard.press("ArrowLeft")
        wait_until(lambda: "no steering" in _status(page, "steered") and _status(page, "steered").startswith("done"),
                   timeout=60, message="the unsteered stream")
        assert _text(page, "steered") == expected_baseline
        time.sleep(0.3)
        assert not page.cb_errors
    finally:
        with CausalboardClient(server_url) as client:
            client.delete_vector(d.name)

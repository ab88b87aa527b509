"""Real-browser test support: Playwright driving Debian's Chromium (`/usr/bin/chromium`).

Use it from a test module with

    pytest_plugins = ["tests.browser"]

which registers the fixtures below (and the hook that tells `page` whether the test failed):

* `browser` (session) — one headless Chromium for the session; every test using it is skipped,
  with the reason, when `/usr/bin/chromium` (or `$CAUSALBOARD_CHROMIUM`) or the `playwright`
  package is missing. `playwright install` is never needed: the system Chromium is launched
  through `executable_path` with the flags that work as root in a container.
* `page` — a fresh browser context + page (1400x1000, downloads accepted, 30 s default
  timeout; fails at once when uvicorn has no WebSocket library, since no served page could connect); on failure a full-page screenshot is saved as `FAILED-<test>.png`. Uncaught page
  errors, failed requests and HTTP error answers are collected in `page.cb_errors` (assert it
  is empty at the end of a test). When the test also uses the `http` fixture, closing the page
  must leave no sweep running on the server (checked for the dashboard's session clean-up time plus slack).

Helpers: `screenshot(page, name)` saves `<out>/screenshots/<name>.png` (out = `$CAUSALBOARD_TEST_OUT`
or `test-output`); `wait_until(predicate, timeout)`; `bokeh_figures(page)` (the browser-side
geometry of every Bokeh figure: title and plot-frame box in page pixels); `bokeh_columns(page,
column)` (the browser-side data of every ColumnDataSource that has `column`); `drag(page, a, b)`.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Callable

import pytest

REPO = Path(__file__).resolve().parents[1]
CHROMIUM = os.environ.get("CAUSALBOARD_CHROMIUM", "/usr/bin/chromium")
#: flags verified with Debian's chromium as root (docs: shared research notes, "Browser tests")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
VIEWPORT = {"width": 1400, "height": 1000}


def out_dir() -> Path:
    out = Path(os.environ.get("CAUSALBOARD_TEST_OUT", "test-output"))
    return out if out.is_absolute() else REPO / out


def screenshot_dir() -> Path:
    path = out_dir() / "screenshots"
    path.mkdir(parents=True, exist_ok=True)
    return path


def screenshot(page: Any, name: str, *, full_page: bool = True) -> Path:
    """Save a screenshot of `page` as `<out>/screenshots/<name>.png`."""
    path = screenshot_dir() / f"{name}.png"
    page.screenshot(path=str(path), full_page=full_page)
    return path


def wait_until(predicate: Callable[[], Any], timeout: float = 30.0, interval: float = 0.1, message: str = "") -> Any:
    """Poll `predicate` until it returns a truthy value (returned); AssertionError on timeout."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {message or predicate} (last: {last!r})")


def choose(page: Any, button: str, effect: Any, tries: int = 3, timeout_s: float = 15.0, other: str | None = None) -> None:
    """Click the choice `button` (a radio-group option) until `effect` (a locator the choice makes
    appear) is there. The click is a round trip through the server's session; a CI run once saw
    its effect never arrive (Chromium ignoring a click on a loaded machine), so a choice gets
    `tries` clicks of `timeout_s` each before the test fails. A radio option the page already
    shows as chosen sends nothing when clicked again, so where the first click did reach the
    page but its effect did not come back, later clicks changed nothing (one run in eight of the
    cancel test, 2026-11-29): with `other` (another option of the same group) each retry clicks
    that one first, so the option's change is sent again."""
    for attempt in range(1, tries + 1):
        if attempt > 1 and other is not None:
            page.get_by_role("button", name=other, exact=True).click()
        page.get_by_role("button", name=button).click()
        try:
            effect.wait_for(timeout=timeout_s * 1000)
            return
        except Exception:
            if attempt == tries:
                raise
            print(f"choose({button!r}): no effect after {timeout_s} s (click {attempt} of {tries}); clicking again")


def machine_load() -> str:
    """The load average and the busiest processes: printed when a browser test fails, because
    every such failure so far was a browser that stopped answering on a loaded machine."""
    import subprocess

    try:
        load = Path("/proc/loadavg").read_text().strip()
        top = subprocess.run(["ps", "-eo", "pid,pcpu,pmem,etimes,args", "--sort=-pcpu"], capture_output=True,
                             text=True, timeout=10).stdout.splitlines()[:8]
    except Exception as exc:  # a diagnostic only
        return f"machine load unavailable: {exc}"
    return "load average: " + load + "\n" + "\n".join(line[:200] for line in top)


_FIGURES_JS = """() => {
  if (typeof Bokeh === 'undefined' || !Bokeh.index) return [];
  const views = [];
  const walk = (v) => { views.push(v); for (const c of (v.child_views || [])) walk(c); };
  const roots = Bokeh.index.roots ? [...Bokeh.index.roots] : Object.values(Bokeh.index);
  for (const r of roots) walk(r);
  const out = [];
  for (const v of views) {
    if (!v.frame || !v.canvas_view || !v.model.title) continue;
    const f = v.frame.bbox, c = v.canvas_view.el.getBoundingClientRect();
    if (c.width === 0) continue;  // in a hidden tab
    out.push({title: v.model.title.text, x: c.x + f.x, y: c.y + f.y, w: f.width, h: f.height});
  }
  return out;
}"""

_COLUMNS_JS = """(column) => {
  const out = [];
  if (typeof Bokeh === 'undefined') return out;
  for (const doc of Bokeh.documents) for (const m of doc.all_models) {
    if (m.type !== 'ColumnDataSource') continue;
    const data = m.data instanceof Map ? Object.fromEntries(m.data) : m.data;
    if (!(column in data)) continue;
    const cols = {};
    for (const [k, v] of Object.entries(data)) cols[k] = Array.from(v, (x) => (typeof x === 'number' && isNaN(x)) ? null : x);
    out.push(cols);
  }
  return out;
}"""


def bokeh_figures(page: Any) -> list[dict]:
    """Visible Bokeh figures: `{"title", "x", "y", "w", "h"}` of each plot frame, page pixels."""
    return page.evaluate(_FIGURES_JS)


def bokeh_columns(page: Any, column: str) -> list[dict]:
    """The browser-side data (`{column: [values]}`, NaN as None) of every ColumnDataSource that
    has `column` — what the browser really shows, not what the server sent."""
    return page.evaluate(_COLUMNS_JS, column)


def drag(page: Any, start: tuple[float, float], end: tuple[float, float], steps: int = 10, pause_ms: int = 40) -> None:
    """Press at `start`, move to `end` in `steps` paced moves, release: a real pointer drag.
    The pauses matter: Bokeh handles pointer moves once per animation frame, so an unpaced burst
    of moves starts its box/pan gesture somewhere along the way instead of at `start`."""
    page.mouse.move(*start)
    page.mouse.down()
    page.wait_for_timeout(pause_ms)
    for k in range(1, steps + 1):
        page.mouse.move(start[0] + k * (end[0] - start[0]) / steps, start[1] + k * (end[1] - start[1]) / steps)
        page.wait_for_timeout(pause_ms)
    page.wait_for_timeout(4 * pause_ms)
    page.mouse.up()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"cb_rep_{report.when}", report)


@pytest.fixture(scope="module")
def browser():
    """Module-scoped on purpose: Playwright's sync API keeps an event loop running in the main
    thread until it stops, which would break every later test that calls asyncio.run()."""
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is missing (the project's setup installs Debian's chromium with apt)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("the playwright package is not installed")
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def page(browser, request):
    from app.dashboard import websocket_library

    if websocket_library() is None:  # a product defect, not a missing test tool: fail, do not skip
        pytest.fail("uvicorn has no WebSocket library (websockets or wsproto): the served dashboard cannot connect")
    http = request.getfixturevalue("http") if "http" in request.fixturenames else None
    context = browser.new_context(viewport=VIEWPORT, accept_downloads=True)
    context.set_default_timeout(30_000)
    pg = context.new_page()
    pg.cb_errors = []
    pg.on("pageerror", lambda exc: pg.cb_errors.append(str(exc)))
    pg.on("requestfailed", lambda req: pg.cb_errors.append(f"request failed: {req.url} ({req.failure})"))
    pg.on("response", lambda resp: resp.status >= 400 and pg.cb_errors.append(f"HTTP {resp.status}: {resp.url}"))
    try:
        yield pg
    finally:
        rep = getattr(request.node, "cb_rep_call", None)
        if rep is not None and rep.failed:
            print(machine_load())
            try:
                screenshot(pg, f"FAILED-{request.node.name}")
            except Exception as exc:  # the page may be gone; the test's own error matters more
                print(f"could not save the failure screenshot: {exc}")
        context.close()
        if http is not None:
            _expect_no_running_sweeps(http)


def _tab_close_cleanup_s() -> float:
    """How long the server may take to clean up a closed tab's session: the unused-session
    lifetime the dashboard is mounted with, one check interval, and slack for a loaded machine."""
    from app.dashboard import CHECK_UNUSED_SESSIONS_MS, UNUSED_SESSION_LIFETIME_MS

    return (UNUSED_SESSION_LIFETIME_MS + CHECK_UNUSED_SESSIONS_MS) / 1000 + 20.0


def _expect_no_running_sweeps(http: Any) -> None:
    """Closing a tab stops the sweeps its session started (the session's cleanup cancels them).
    Checked after every browser test, so a test that failed mid-sweep cannot leave a sweep
    (and its leased source run) running into the next test."""
    wait_until(lambda: http.get("/v1/status").json()["sweeps"]["active"] == 0, timeout=_tab_close_cleanup_s(),
               message="the closed tab's sweeps to be cancelled by its session cleanup")

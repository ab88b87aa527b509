"""`TracingView`: the causal-tracing view (a Panel component for the served page and notebooks).

    import panel as pn; pn.extension()
    from app.dashboard.tracing.view import TracingView
    view = TracingView("http://127.0.0.1:8000")      # or an (Async)CausalboardClient
    view                                             # the form, live heatmaps, status, exports
    view.start(view.form().to_request())             # or click "Run sweep"; `await view.wait()`
    view.replay([{"type": "summary", **SweepResult.load("sweep.npz").to_summary()}])  # a saved sweep

How it streams (the pattern verified in the project's front-end research notes: Bokeh models
must not be changed from an asyncio task): `start` launches an asyncio task that reads the SSE events of
`POST /v1/patch_sweep` (`stream: true`, `keep_source: true`) through `AsyncCausalboardClient`
and only appends them to a buffer; a 100 ms periodic callback drains the buffer into the pure
`SweepState` (the sweep's event fold, `app.sweep.fold.SweepFold`), then sends each heatmap ONE
incremental update. The view talks to the API over HTTP only.

Contracts:

* Starting a sweep cancels the running one; `cancel()` closes the stream (the server then cancels
  the remaining cells). Events of a replaced sweep are never shown (each run has a generation).
* The first sweep keeps its clean run on the server (`keep_source`); "Zoom" re-sweeps the
  rectangle selected on a heatmap (every layer and position inside it) from that run
  (`source_run` + the same `clean_prompt`). A new, non-zoom sweep drops the kept run
  (`DELETE /v1/patch_source/{id}`) first; closing the browser session drops it too.
* Export buttons call `app.figures.export.export_bytes(result, fmt, hook)` on the current result (the
  manifest: `app.figures.export.export_sweep`); file names are those `export_sweep` uses, so the
  downloaded files match the manifest's names and checksums.
"""

from __future__ import annotations

import asyncio
import contextlib
import html
import io
import logging
import math
import time
from typing import Any, Iterable

import httpx
import panel as pn

from app.client import CausalboardError
from app.dashboard.tracing.heatmap import METRIC_FORMULAS, SweepHeatmap, legend_html, visible_token
from app.dashboard.tracing.form import CORRUPT_PROMPT, METRICS, NOISE_SPAN, SweepForm, default_form, zoom_request
from engine_ext.errors import SpecError
from engine_ext.sites import HOOKS
from app.dashboard.tracing.state import SweepState
from app.sweep.fold import CellStatus
from app.sweep.schema import SummaryEvent, SweepEventError

logger = logging.getLogger("causalboard.dashboard")

DEFAULT_URL = "http://127.0.0.1:8000"
#: how often the periodic callback moves the stream's events into the view (status, progress)
FLUSH_MS = 200
#: while a sweep runs, heatmap cells are pushed to the browser at most this often: every push
#: re-renders the figures, and a browser sharing a loaded machine with the engine must keep up
#: (the final summary and any re-layout are pushed at once)
HEATMAP_PUSH_MS = 500
#: download buttons: (label, format); "manifest" is the manifest `export_sweep` writes, the others
#: are `export_bytes` formats
EXPORTS = (("PDF", "pdf"), ("SVG", "svg"), ("PNG", "png"), ("CSV", "csv"), ("NPZ", "npz"),
           ("Manifest JSON", "manifest"), ("ZIP (all files)", "zip"))
FIGURE_FORMATS = ("pdf", "svg", "png")


def export_filename(stem: str, fmt: str, hook: str | None) -> str:
    """The name `app.figures.export.export_sweep` gives the same file (`<stem>_<hook>.pdf`,
    `<stem>.csv`, `<stem>.manifest.json`, …), so downloads match the manifest's file names."""
    if fmt in FIGURE_FORMATS:
        return f"{stem}_{hook}.{fmt}" if hook else f"{stem}.{fmt}"
    return f"{stem}.manifest.json" if fmt == "manifest" else f"{stem}.{fmt}"


def export_payload(result: Any, fmt: str, hook: str | None, stem: str) -> bytes:
    """The bytes of one download (lazy import: `app.figures.export` is written separately and pulls in
    matplotlib)."""
    from app.figures import export

    if fmt != "manifest":
        return export.export_bytes(result, fmt, hook=hook)
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory(prefix="causalboard-dash-") as tmp:
        export.export_sweep(result, tmp, stem=stem)
        return (Path(tmp) / f"{stem}.manifest.json").read_bytes()


def make_async_client(client_or_url: Any = DEFAULT_URL, api_key: str | None = None):
    """An `AsyncCausalboardClient` for a URL, an async client (returned as is) or a sync
    `CausalboardClient` (same base URL)."""
    from app.client import AsyncCausalboardClient

    if isinstance(client_or_url, AsyncCausalboardClient):
        return client_or_url
    if isinstance(client_or_url, str):
        return AsyncCausalboardClient(client_or_url, api_key=api_key)
    base = getattr(client_or_url, "base_url", None)
    if base is None:
        raise TypeError(f"expected a URL or a causalboard client, got {type(client_or_url).__name__}")
    if api_key is None:  # reuse the sync client's bearer key
        http = getattr(client_or_url, "_http", None)
        auth = http.headers.get("authorization", "") if http is not None else ""
        api_key = auth.partition(" ")[2] or None
    return AsyncCausalboardClient(str(base), api_key=api_key)


class TracingView(pn.viewable.Viewer):
    """The causal-tracing form, live per-hook heatmaps, status, zoom and export."""

    def __init__(self, client_or_url: Any = DEFAULT_URL, *, api_key: str | None = None, form: SweepForm | None = None,
                 hooks: tuple[str, ...] = HOOKS, **params: Any):
        super().__init__(**params)
        self.client = make_async_client(client_or_url, api_key)
        self.state = SweepState()
        self.heatmaps: dict[str, SweepHeatmap] = {}
        self._events: list[tuple[int, dict]] = []  # (generation, event), filled by the stream task
        self._generation = 0
        self._task: asyncio.Task | None = None
        self._running = False
        self._cancelled_by_user = False
        self._flusher = None
        self._request: dict | None = None  # the current sweep's request (base of zooms)
        self._zoom = False
        self._kept_run: str | None = None  # clean run kept on the server for zooms
        self._fetching = False  # fetching a cancelled sweep's final summary
        self._heatmaps_pushed_at = 0.0
        self._done = asyncio.Event()
        self._build_widgets(form or default_form(), hooks)
        self._layout = self._build_layout()
        if pn.state.curdoc is not None and pn.state.curdoc.session_context is not None:
            pn.state.on_session_destroyed(self._on_session_destroyed)

    def __panel__(self):
        return self._layout

    # ---- widgets ------------------------------------------------------------------------------
    def _build_widgets(self, f: SweepForm, hooks: tuple[str, ...]) -> None:
        w = pn.widgets
        full, half, third = dict(width=380), dict(width=185), dict(width=120)
        self.w_corruption = w.RadioButtonGroup(label="Corruption", options=[CORRUPT_PROMPT, NOISE_SPAN], value=f.corruption, **full)
        self.w_clean = w.TextInput(label="Clean prompt", value=f.clean_prompt, **full)
        self.w_corrupt = w.TextInput(label="Corrupt prompt", value=f.corrupt_prompt, **full)
        self.w_subject = w.TextInput(label="Subject in the corrupt prompt (marked *; optional)", value=f.subject, **full)
        self.w_noise_span = w.TextInput(label="Noise span (text in the prompt)", value=f.noise_span, **full)
        self.w_noise_scale = w.FloatInput(label="Noise scale (× emb. std)", value=f.noise_scale, start=0.0, end=100.0, step=0.5, **third)
        self.w_noise_samples = w.IntInput(label="Noise samples", value=f.noise_samples, start=1, end=32, **third)
        self.w_noise_seed = w.IntInput(label="Noise seed", value=f.noise_seed, start=0, **third)
        self.w_answer = w.TextInput(label="Answer (one token, verbatim)", value=f.answer, **half)
        self.w_foil = w.TextInput(label="Foil (one token)", value=f.foil, **half)
        self.w_layers = w.TextInput(label="Layers", value=f.layers, placeholder="all | 0-5 | 0,2,4 | 0:6:2", **half)
        self.w_positions = w.TextInput(label="Positions", value=f.positions, placeholder="all | 1-3 | span:Garrow", **half)
        self.w_hooks = w.CheckButtonGroup(label="Hooks", options=list(hooks), value=[h for h in f.hooks if h in hooks], **full)
        self.w_metric = w.Select(label="Metric", options=list(METRICS), value=f.metric, **half)
        self.w_alpha = w.FloatInput(label="alpha: (1−α)·h + α·clean", value=f.alpha, start=0.0, end=1.0, step=0.1, **half)
        self.w_concurrency = w.IntInput(label="Cells in flight", value=f.max_concurrency, start=1, end=1024, **half)
        self.b_run = w.Button(label="Run sweep", color="primary", width=120)
        self.b_cancel = w.Button(label="Cancel", color="warning", disabled=True, width=120)
        self.b_zoom = w.Button(label="Zoom into selection", disabled=True, width=250,
                               description="Drag a box over a heatmap, then re-sweep every layer × position inside it")
        self.b_run.on_click(lambda _e: self.run_form())
        self.b_cancel.on_click(lambda _e: self.cancel())
        self.b_zoom.on_click(lambda _e: self.zoom())
        self.w_corruption.param.watch(lambda _e: self._show_corruption_fields(), "value")
        self.error = pn.pane.Alert("", alert_type="danger", visible=False, width=380)
        self.progress = pn.indicators.Progress(value=0, max=1000, sizing_mode="stretch_width", height=14, bar_color="primary")
        self.status = pn.pane.HTML(self._status_html(), sizing_mode="stretch_width")
        self.key = pn.pane.HTML(legend_html(), sizing_mode="stretch_width", min_height=30)
        self.maps = pn.FlexBox(pn.pane.HTML('<p style="color:#666">Run a sweep to see one heatmap per hook.</p>'),
                               flex_wrap="wrap", gap="8px", sizing_mode="stretch_width")
        self.w_export_hook = w.Select(label="Figure of hook", options=list(f.hooks), width=150)
        self.w_export_hook.param.watch(lambda _e: self._update_controls(), "value")
        self.downloads = [w.FileDownload(label=label, filename=export_filename("sweep", fmt, None), callback=self._exporter(fmt),
                                         embed=False, disabled=True, width=118) for label, fmt in EXPORTS]
        self._show_corruption_fields()

    def _build_layout(self) -> pn.viewable.Viewable:
        form = pn.Column(
            self.w_corruption, self.w_clean, self.w_corrupt, self.w_subject, self.w_noise_span,
            pn.Row(self.w_noise_scale, self.w_noise_samples, self.w_noise_seed),
            pn.Row(self.w_answer, self.w_foil), pn.Row(self.w_layers, self.w_positions),
            self.w_hooks, pn.Row(self.w_metric, self.w_alpha), self.w_concurrency,
            pn.Row(self.b_run, self.b_cancel), self.b_zoom, self.error,
            width=400, min_width=400,
        )
        export = pn.FlexBox(self.w_export_hook, *self.downloads, flex_wrap="wrap", align_items="flex-end", gap="6px",
                            sizing_mode="stretch_width")
        results = pn.Column(self.progress, self.status, self.key, self.maps, pn.pane.HTML("<b>Export</b>"), export,
                            sizing_mode="stretch_width", min_width=600)
        return pn.Row(form, results, sizing_mode="stretch_width")

    def _show_corruption_fields(self) -> None:
        noise = self.w_corruption.value == NOISE_SPAN
        self.w_corrupt.visible = self.w_subject.visible = not noise
        for wid in (self.w_noise_span, self.w_noise_scale, self.w_noise_samples, self.w_noise_seed):
            wid.visible = noise
        self.w_clean.label = "Prompt (gets noise on the span)" if noise else "Clean prompt"

    def form(self) -> SweepForm:
        """The form's current values."""
        return SweepForm(
            clean_prompt=self.w_clean.value, corrupt_prompt=self.w_corrupt.value, corruption=self.w_corruption.value,
            subject=self.w_subject.value,
            noise_span=self.w_noise_span.value, noise_scale=float(self.w_noise_scale.value or 0.0),
            noise_samples=int(self.w_noise_samples.value or 1), noise_seed=int(self.w_noise_seed.value or 0),
            answer=self.w_answer.value, foil=self.w_foil.value, layers=self.w_layers.value, positions=self.w_positions.value,
            hooks=list(self.w_hooks.value), metric=self.w_metric.value, alpha=float(self.w_alpha.value),
            max_concurrency=int(self.w_concurrency.value or 64),
        )

    def set_form(self, f: SweepForm) -> None:
        """Fill the form (e.g. with another model's default pair)."""
        self.w_corruption.value = f.corruption
        self.w_clean.value, self.w_corrupt.value, self.w_subject.value = f.clean_prompt, f.corrupt_prompt, f.subject
        self.w_noise_span.value = f.noise_span
        self.w_answer.value, self.w_foil.value = f.answer, f.foil

    # ---- actions ------------------------------------------------------------------------------
    def run_form(self) -> None:
        """Start a sweep from the form (the Run button)."""
        try:
            request = self.form().to_request()
        except SpecError as exc:
            self._show_error(f"{exc.field}: {exc.message}")
            return
        self.start(request)

    def start(self, request: dict, *, zoom: bool = False) -> None:
        """Start streaming a sweep of `request` (a `POST /v1/patch_sweep` body); cancels the
        running one. A non-zoom sweep first drops the clean run kept by the previous one."""
        self._stop_stream()
        self._generation += 1
        gen = self._generation
        self._events.clear()
        self.state = SweepState()
        self._request, self._zoom = dict(request), zoom
        self._cancelled_by_user = False
        self._running = True
        self._done.clear()
        drop = None
        if not zoom:
            drop, self._kept_run = self._kept_run, None
        body = {**request, "stream": True, "keep_source": True}
        self._show_error(None)
        self._update_controls()
        self.status.object = self._status_html()
        self._ensure_flusher()

        async def consume() -> None:
            await self._consume(body, gen, drop)

        pn.state.execute(consume)

    def cancel(self) -> None:
        """Cancel the running sweep: close its stream (the server cancels the remaining cells),
        then show the server's final summary of it (marked cancelled) once it is written."""
        if not self._running:
            return
        self._stop_stream()
        self._cancelled_by_user = True
        self._finish_run()
        self._flush()
        sweep_id = self.state.sweep_id
        if sweep_id is not None:
            self._fetching = True
            self._ensure_flusher()
            gen = self._generation

            async def fetch() -> None:
                await self._fetch_summary(sweep_id, gen)

            pn.state.execute(fetch)

    def zoom(self) -> None:
        """Re-sweep the rectangle selected on a heatmap from the kept clean run."""
        block = next((b for b in (hm.selected_block() for hm in self.heatmaps.values()) if b is not None), None)
        if block is None:
            self._show_error("zoom: select cells first (drag a box over a heatmap with the box-select tool)")
            return
        if self._request is None or self._kept_run is None:
            self._show_error("zoom: the previous sweep's clean run is not kept on the server (it was cancelled or failed); run a sweep first")
            return
        layers, positions = block
        self.start(zoom_request(self._request, layers, positions, self._kept_run), zoom=True)

    def replay(self, events: Iterable[dict]) -> SweepState:
        """Show recorded events (a saved stream, or `[{"type": "summary", **summary}]` for a
        saved result) instead of a live sweep; cancels the running one. Returns the state."""
        self._stop_stream()
        self._running = False
        self.state = SweepState()
        self._request, self._zoom, self._cancelled_by_user = None, False, False
        self._show_error(None)
        kept = self._kept_run  # a recorded summary's run may be long gone: never zoom from it
        self._events = [(self._generation, dict(ev)) for ev in events]
        self._flush()
        self._kept_run = kept
        self._update_controls()
        return self.state

    async def wait(self, timeout: float | None = None) -> SweepState:
        """Wait until the running sweep has ended and its events are shown (notebooks)."""
        if self._running:
            await asyncio.wait_for(self._done.wait(), timeout)
        while any(g == self._generation for g, _ in self._events):  # let the periodic callback show them
            await asyncio.sleep(FLUSH_MS / 1000)
        return self.state

    @property
    def running(self) -> bool:
        return self._running

    @property
    def kept_run(self) -> str | None:
        """The clean run kept on the server for zooms (None when there is none)."""
        return self._kept_run

    # ---- the stream task (no Bokeh model is touched here) ---------------------------------
    async def _consume(self, body: dict, gen: int, drop: str | None) -> None:

        def push(ev: dict) -> None:  # events of a replaced sweep are dropped here
            if gen == self._generation:
                self._events.append((gen, ev))

        if gen != self._generation:
            return
        self._task = asyncio.current_task()
        self._task_loop = asyncio.get_running_loop()
        try:
            if drop is not None:
                with contextlib.suppress(CausalboardError, httpx.HTTPError):
                    await self.client.drop_source(drop)
            if gen != self._generation:
                return
            try:
                await self._stream(body, gen, push)
            except CausalboardError as exc:
                if exc.status != 507 or not body.get("keep_source"):
                    raise
                # keeping the clean run of every hook (for zooms) does not fit the source store:
                # run the sweep without keeping it
                push({"type": "warning", "message": f"zoom is off for this sweep: {exc.message}"})
                await self._stream({**body, "keep_source": False}, gen, push)
        except CausalboardError as exc:
            push({"type": "_failed", "message": exc.message if exc.status else str(exc)})
        except httpx.HTTPError as exc:
            push({"type": "_failed", "message": f"connection to the API failed: {exc!r}"})
        finally:
            push({"type": "_ended"})

    async def _stream(self, body: dict, gen: int, push: Any) -> None:
        async with contextlib.aclosing(self.client.stream_sweep(**body)) as stream:
            async for ev in stream:
                if gen != self._generation:
                    return  # closing the stream cancels the sweep on the server
                push(ev)

    async def _fetch_summary(self, sweep_id: str, gen: int, timeout: float = 60.0) -> None:
        """After a cancel: follow the sweep's replay stream (`GET /v1/patch_sweep/{id}/events`)
        until the server has written its summary (marked cancelled), and show that summary."""

        async def final_summary() -> dict | None:
            async with contextlib.aclosing(self.client.sweep_events(sweep_id)) as events:
                async for ev in events:
                    if ev.get("type") == "summary":
                        return ev
            return None

        try:
            summary = await asyncio.wait_for(final_summary(), timeout)
            if summary is not None and gen == self._generation:
                self._events.append((gen, summary))
        except (CausalboardError, httpx.HTTPError, asyncio.TimeoutError) as exc:
            logger.warning("could not read the final summary of sweep %s: %s", sweep_id, exc)
        finally:
            self._fetching = False

    def _stop_stream(self) -> None:
        self._generation += 1
        task, self._task = self._task, None
        if task is not None and not task.done():
            # Bokeh may call us from a worker thread: cancel on the task's own loop
            self._task_loop.call_soon_threadsafe(task.cancel)
            sweep_id = self.state.sweep_id
            if sweep_id is not None:
                # closing the stream makes the server cancel the sweep; say it explicitly too, so
                # the cells stop even if the disconnect is noticed late
                async def cancel_on_server() -> None:
                    with contextlib.suppress(CausalboardError, httpx.HTTPError):
                        await self.client.cancel_sweep(sweep_id)

                asyncio.run_coroutine_threadsafe(cancel_on_server(), self._task_loop)

    # ---- periodic flush (holds the Bokeh document lock when served) -------------------------
    def _ensure_flusher(self) -> None:
        if self._flusher is None or not self._flusher.running:
            self._flusher = pn.state.add_periodic_callback(self._flush, period=FLUSH_MS, start=True)

    def _flush(self) -> None:
        pending, self._events = self._events, []
        for gen, ev in pending:
            if gen != self._generation:
                continue
            kind = ev.get("type")
            if kind == "_ended":
                self._finish_run()
            elif kind == "_failed":
                self._show_error(ev["message"])
                self._finish_run()
            else:
                try:
                    folded = self.state.apply(ev)
                except SweepEventError as exc:
                    self._show_error(f"malformed sweep event: {exc}")
                    continue
                if isinstance(folded, SummaryEvent):
                    self._adopt_summary(folded)
        rebuilt = self.state.axes_changed
        if rebuilt:
            self.state.axes_changed = False
            self._build_heatmaps()
            self._update_controls()
        now = time.monotonic()
        if rebuilt or not self._running or now - self._heatmaps_pushed_at >= HEATMAP_PUSH_MS / 1000:
            self._heatmaps_pushed_at = now
            self._update_heatmaps()
        self.progress.value = int(1000 * self.state.fraction_done)
        self.status.object = self._status_html()
        if not self._running and not self._fetching and not self._events and self._flusher is not None:
            self._flusher.stop()
            self._update_controls()

    def _finish_run(self) -> None:
        self._running = False
        self._update_controls()
        self._done.set()

    def _adopt_summary(self, summary: SummaryEvent) -> None:
        kept = summary.source_kept
        if kept is None:  # servers without the field: kept when auto-captured and not cancelled
            kept = summary.auto_captured and not summary.cancelled
        new = summary.captured_source_run if kept else None
        if new and self._kept_run and new != self._kept_run:
            self._drop_later(self._kept_run)
        if new:
            self._kept_run = new
        elif not self._zoom:
            self._kept_run = None

    def _build_heatmaps(self) -> None:
        r = self.state.result
        marked = set(r.meta.get("subject_positions") or [])
        self.heatmaps = {}
        panes = []
        for hook in r.hooks:
            hm = SweepHeatmap(hook, r.layers, r.positions, r.token_strings, r.metric, baselines=self._baselines(),
                              title=f"{hook} · {r.metric}" + (" · zoom" if self._zoom else ""), marked=marked)
            self.heatmaps[hook] = hm
            panes.append(pn.pane.Bokeh(hm.figure))
        self.maps.objects = panes
        self.w_export_hook.options = list(r.hooks)
        self.w_export_hook.value = r.hooks[0]

    def _baselines(self) -> list[float | None]:
        """Values the colour scale must span: the clean/corrupt baselines for raw metrics."""
        r = self.state.result
        if r is None or r.metric in ("recovered", "logit_diff"):
            return []
        return [self.state.clean, self.state.corrupt]

    def _update_heatmaps(self) -> None:
        dirty = self.state.take_dirty()
        if not dirty or not self.heatmaps:
            return
        by_hook: dict[str, list] = {}
        for hook, i, j in dirty:
            value, status, reason = self.state.cell(hook, i, j)
            by_hook.setdefault(hook, []).append((i, j, value, status, reason))
        for hook, cells in by_hook.items():
            if hook in self.heatmaps:
                self.heatmaps[hook].update(cells)

    def _update_controls(self) -> None:
        self.b_cancel.disabled = not self._running
        self.b_zoom.disabled = self._running or self._kept_run is None
        has_result = self.state.result is not None  # during a sweep too: cells not run yet are "pending"
        for d in self.downloads:
            d.disabled = not has_result
        if has_result:
            stem, hook = self._export_stem(), self._export_hook()
            for d, (_label, fmt) in zip(self.downloads, EXPORTS):
                d.filename = export_filename(stem, fmt, hook)

    def _export_stem(self) -> str:
        sid = self.state.sweep_id
        return f"sweep-{sid}" if sid else "sweep"

    def _export_hook(self) -> str | None:
        r = self.state.result
        hook = self.w_export_hook.value
        return hook if r is not None and hook in r.hooks else (r.hooks[0] if r is not None else None)

    def _show_error(self, message: str | None) -> None:
        self.error.object = html.escape(message or "")
        self.error.visible = bool(message)

    # ---- export ---------------------------------------------------------------------------
    def _exporter(self, fmt: str):
        def produce() -> io.BytesIO:
            r = self.state.result
            if r is None:
                raise RuntimeError("no sweep to export yet")
            return io.BytesIO(export_payload(r, fmt, self._export_hook(), self._export_stem()))

        return produce

    # ---- status ---------------------------------------------------------------------------
    def _status_html(self) -> str:
        s = self.state
        r = s.result
        if r is None:
            phase = "starting (capturing the clean run and baselines)…" if self._running else "idle"
            if self._cancelled_by_user:
                phase = "cancelled before the first cell"
            return _status_block([("Sweep", _span("phase", phase))])
        if s.finished:
            phase = "cancelled" if s.cancelled else "finished"
        elif self._cancelled_by_user:
            phase = "cancelled"
        else:
            phase = "running"
        rate = s.cells_per_s
        progress = (f'<span data-cb="progress" data-done="{s.cells_done}" data-total="{s.cells_total}" '
                    f'data-final="{int(s.finished)}">{s.cells_done}/{s.cells_total} cells</span>'
                    f" · {('%.1f cells/s' % rate) if rate else '— cells/s'} · {s.elapsed_s:.1f} s · "
                    + _span("phase", phase))
        if s.cells_voided:
            progress += f" · {s.cells_voided} voided"
        if s.noise_floor is None:
            noise = _span("noise-floor", "not measured" if s.finished or self._cancelled_by_user else "pending")
        else:
            noise = (_span("noise-floor", f"{s.noise_floor:.4g}") + f" ({html.escape(r.metric)} units) · "
                     f"{s.count(CellStatus.NOISE)} cells within it")
        rows = [
            ("Progress", progress),
            ("Noise floor", noise),
            ("Alignment", self._alignment_html()),
            ("Checksum", _span("checksum", s.checksum_text())),
            ("Baselines", self._baselines_html()),
            ("Sweep", self._sweep_html()),
        ]
        for w in s.warnings:
            rows.append(("Note", html.escape(w)))
        for e in s.errors:
            rows.append(("Error", f'<span style="color:#b00">{html.escape(e)}</span>'))
        return _status_block(rows)

    def _alignment_html(self) -> str:
        s, r = self.state, self.state.result
        if r.meta.get("noise"):
            pos = r.meta["noise"].get("positions") or []
            return _span("alignment", f"same prompt (noise on positions {', '.join(map(str, pos))})")
        a = s.alignment
        if not a:
            return _span("alignment", "identity (stored run)")
        unaligned = list(a.unaligned_positions)
        toks = r.meta.get("token_strings") or []
        if unaligned:
            shown = ", ".join(f"{p}:{html.escape(visible_token(toks[p]))}" if p < len(toks) else str(p) for p in unaligned)
            un = f"unaligned (skipped) positions: {shown}"
        else:
            un = "no unaligned positions"
        text = f"clean {a.n_clean} / corrupt {a.n_corrupt} tokens · prefix {a.prefix_len} · suffix {a.suffix_len} · {un}"
        return _span("alignment", text)

    def _baselines_html(self) -> str:
        s, r = self.state, self.state.result
        basis = r.meta.get("recovered_basis") or r.metric
        def fmt(v: float | None) -> str:
            return "—" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.4g}"
        ans, foil = r.meta.get("answer_token"), r.meta.get("foil_token")
        out = f"clean {html.escape(basis)} {fmt(s.clean)} · corrupt {fmt(s.corrupt)}"
        if ans is not None:
            out += f" · answer “{html.escape(visible_token(ans))}”"
        if foil is not None:
            out += f" · foil “{html.escape(visible_token(foil))}”"
        formula = METRIC_FORMULAS.get(r.metric)
        if formula:
            out += f" · {html.escape(formula)}"
        return out

    def _sweep_html(self) -> str:
        r = self.state.result
        direction = "denoising: clean activations patched into the corrupt run"
        parts = [f"id {_span('sweep-id', r.meta.get('sweep_id') or '?')}", html.escape(direction)]
        if self._zoom:
            parts.append("zoom of the previous sweep")
        if self._kept_run:
            parts.append(f"clean run kept for zoom: {html.escape(self._kept_run)}")
        return " · ".join(parts)

    # ---- lifecycle ------------------------------------------------------------------------
    def _drop_later(self, run_id: str) -> None:

        async def drop() -> None:
            with contextlib.suppress(CausalboardError, httpx.HTTPError):
                await self.client.drop_source(run_id)

        with contextlib.suppress(RuntimeError):  # no running loop: nothing to schedule on
            asyncio.get_running_loop().create_task(drop())

    def _on_session_destroyed(self, _session_context: Any) -> None:
        self._stop_stream()
        self._running = False
        if self._flusher is not None:
            self._flusher.stop()
        run, self._kept_run = self._kept_run, None

        async def cleanup() -> None:
            from app.client import CausalboardError

            try:
                if run is not None:
                    with contextlib.suppress(CausalboardError, httpx.HTTPError):
                        await self.client.drop_source(run)
            finally:
                await self.client.aclose()

        with contextlib.suppress(RuntimeError):
            asyncio.get_running_loop().create_task(cleanup())


def _span(name: str, text: str) -> str:
    return f'<span data-cb="{name}">{html.escape(str(text))}</span>'


def _status_block(rows: list[tuple[str, str]]) -> str:
    body = "".join(f'<div><b>{html.escape(k)}:</b> {v}</div>' for k, v in rows)
    return f'<div class="cb-status" style="font-size:13px;line-height:1.55">{body}</div>'


__all__ = ["EXPORTS", "TracingView", "export_filename", "export_payload", "make_async_client"]

"""`TracingView`: the causal-tracing view, one Panel component for the served page (`panel serve`
or the FastAPI mount, `app/dashboard/app.py`) and for notebook cells.

    import panel as pn; pn.extension()
    from app.dashboard.tracing.view import TracingView
    view = TracingView("http://127.0.0.1:8000")      # or an (Async)CausalboardClient; default $CAUSALBOARD_URL
    view                                             # the form, live heatmaps, status, exports
    view.param.update(hooks=["pre_attn", "post_block"], layers="0-3")
    view.param.trigger("run_sweep")                  # = the "Run sweep" button; or view.start(request)
    state = await view.wait()                        # the finished sweep's `SweepState`
    view.replay([{"type": "summary", **SweepResult.load("sweep.npz").to_summary()}])  # a saved sweep

State as declared parameters
----------------------------
* the **form**: `corruption`, `clean_prompt`, `corrupt_prompt`, `subject`, `noise_span`,
  `noise_scale`, `noise_samples`, `noise_seed`, `answer`, `foil`, `layers`, `positions`,
  `hooks`, `metric`, `alpha`, `max_concurrency` (`form()` is them as a `SweepForm`);
* the **actions**: `run_sweep`, `cancel_sweep`, `zoom_in` (events; the buttons trigger them);
* the **run** (set by the view, read or watch them): `phase` (idle / running / done /
  cancelled / failed), `sweep_id`, `progress` (0-1), `result` (the `SweepResult` shown),
  `kept_run` (the clean run kept on the server for zooms), `zoomed` (the shown sweep is a zoom),
  `selection` (the (layers, positions) rectangle last box-selected on a heatmap), `error`,
  `status_html`, `export_hook`.

Every widget is bound to these (`from_param`, `pn.bind`): which controls are enabled, which
corruption fields are visible and the download names are derived from them, never set from
several places.

How it streams (Bokeh models must not be changed from an asyncio task): `start` launches a task
that reads the SSE events of `POST /v1/patch_sweep` (`stream: true`, `keep_source: true`) through
`AsyncCausalboardClient` and only appends them to a buffer; a periodic fold (`_flush` every
`FLUSH_MS`: the session's periodic callback on a served page, the view's own task elsewhere)
folds the buffer into `state` (a `SweepState`, the sweep's one event reader
`app.sweep.fold.SweepFold`), updates the run parameters, and sends the heatmaps' cells through
ONE method (`_push_cells`: one `ColumnDataSource.patch` per heatmap, at most every
`HEATMAP_PUSH_MS` while the sweep runs). The view talks to the API over HTTP only.

In a notebook cell, `browser` (`app.dashboard.notebook.BrowserSync`) keeps the output's copy in
the browser in step: the output's comms are taken over as it is displayed (the browser's messages
are handled on the kernel's main loop, not on a JupyterLab subshell's thread; updates made before
the browser opened the output, as with Run All, are sent in order once it does), and after each
render what the document holds (the heatmaps' cell patches) is pushed at once.

Contracts
---------
* Starting a sweep cancels the running one; `cancel()` closes the stream and asks the server to
  cancel (`DELETE /v1/patch_sweep/{id}`), then shows the server's final summary (marked
  cancelled). Events of a replaced sweep are never shown (each run has a generation).
* A sweep keeps its clean run on the server (`keep_source`; without room for it, 507, it runs
  without and says zoom is off); `zoom()` re-sweeps `selection` from that run (`source_run` +
  the same `clean_prompt`). A new non-zoom sweep drops the kept run first
  (`DELETE /v1/patch_source/{id}`).
* Clean-up, wherever the view lives: `aclose()` cancels the running sweep, drops the kept run
  and closes the client the view made. A served page calls it when its session is destroyed
  (the tab closed); in a notebook kernel (or any process) whatever is still open at interpreter
  exit is cancelled and dropped with a synchronous client (`atexit`).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import html
import io
import logging
import threading
import time
import weakref
from typing import Any, Awaitable, Callable, Iterable

import httpx
import panel as pn
import param

from app.client import CausalboardError
from app.client.factory import async_client, sync_twin
from app.dashboard.notebook import BrowserSync, NotebookOutputs
from app.dashboard.tracing.downloads import EXPORTS, export_filename, export_payload, export_stem
from app.dashboard.tracing.form import CORRUPT_PROMPT, METRICS, NOISE_SPAN, SweepForm, default_form, zoom_request
from app.dashboard.tracing.heatmap import SweepHeatmap, block_of, legend_html
from app.dashboard.tracing.state import SweepState
from app.dashboard.tracing.status import PHASES, status_html
from app.figures.presentation import noise_threshold
from app.sweep.result import SweepResult
from app.sweep.schema import SummaryEvent, SweepEventError
from engine_ext.errors import SpecError
from engine_ext.sites import HOOKS

logger = logging.getLogger("causalboard.dashboard")

#: how often the periodic callback moves the stream's events into the view (status, progress)
FLUSH_MS = 200
#: while a sweep runs, heatmap cells are pushed to the browser at most this often: every push
#: re-renders the figures, and a browser sharing a loaded machine with the engine must keep up
#: (the final summary and any re-layout are pushed at once)
HEATMAP_PUSH_MS = 500
#: how long `cancel()` waits for the server's final summary of the cancelled sweep
SUMMARY_TIMEOUT_S = 60.0

_EVENT, _ENDED, _FAILED = "event", "ended", "failed"


class TracingView(NotebookOutputs, pn.viewable.Viewer):
    """The causal-tracing form, live per-hook heatmaps, status, zoom and export."""

    # ---- the form ---------------------------------------------------------------------------
    corruption = param.Selector(default=CORRUPT_PROMPT, objects=[CORRUPT_PROMPT, NOISE_SPAN],
                                doc="patch a clean prompt into a corrupt one, or Gaussian noise on a span of one prompt")
    clean_prompt = param.String(default="", doc="the clean prompt (with noise: the prompt that gets noise)")
    corrupt_prompt = param.String(default="", doc="the corrupt prompt (the sweep's `prompt`)")
    subject = param.String(default="", doc="the subject's text in the corrupt prompt, marked * (optional)")
    noise_span = param.String(default="", doc="the text in the prompt whose input embeddings get noise")
    noise_scale = param.Number(default=3.0, bounds=(0.0, 100.0), doc="noise size, x the embedding matrix's std")
    noise_samples = param.Integer(default=1, bounds=(1, 32), doc="noise draws averaged per cell")
    noise_seed = param.Integer(default=0, bounds=(0, None), doc="the first noise draw's seed")
    answer = param.String(default="", doc="the answer token, verbatim")
    foil = param.String(default="", doc="the foil token, verbatim (needed for logit_diff)")
    layers = param.String(default="all", doc="layer selector: all | 0-5 | 0,2,4 | 0:6:2")
    positions = param.String(default="all", doc="position selector: all | 1-3 | span:TEXT#N")
    hooks = param.ListSelector(default=["post_block"], objects=list(HOOKS), doc="one heatmap per hook")
    metric = param.Selector(default="recovered", objects=list(METRICS))
    alpha = param.Number(default=1.0, bounds=(0.0, 1.0), doc="(1-alpha)·h + alpha·clean")
    max_concurrency = param.Integer(default=64, bounds=(1, 1024), doc="cells in flight")

    # ---- actions ----------------------------------------------------------------------------
    run_sweep = param.Event(doc="start a sweep of the form (cancels the running one)")
    cancel_sweep = param.Event(doc="cancel the running sweep")
    zoom_in = param.Event(doc="re-sweep `selection` from the kept clean run")

    # ---- the run (set by the view) ----------------------------------------------------------
    phase = param.Selector(default="idle", objects=list(PHASES), doc="idle, running, done, cancelled or failed")
    sweep_id = param.String(default=None, allow_None=True, doc="the shown sweep's id")
    progress = param.Number(default=0.0, bounds=(0.0, 1.0), doc="fraction of the shown sweep's cells done")
    result = param.ClassSelector(class_=SweepResult, default=None, allow_None=True, doc="the shown sweep's result so far")
    kept_run = param.String(default=None, allow_None=True, doc="the clean run kept on the server for zooms")
    zoomed = param.Boolean(default=False, doc="the shown sweep is a zoom of the previous one")
    selection = param.Parameter(default=None, doc="(layers, positions) box-selected on a heatmap, or None")
    error = param.String(default="", doc="the last error (bad form input, a failed request)")
    status_html = param.String(default="", doc="the status block (HTML)")
    export_hook = param.Selector(default=None, objects=[], allow_None=True, doc="the hook the figure downloads draw")

    def __init__(self, client_or_url: Any = None, *, api_key: str | None = None, form: SweepForm | None = None,
                 hooks: tuple[str, ...] = HOOKS, **params: Any):
        """`client_or_url`: a base URL (default `$CAUSALBOARD_URL`, else http://127.0.0.1:8000),
        a sync `CausalboardClient` or an `AsyncCausalboardClient` (used as is and not closed by
        the view); `api_key` for the URL's guarded endpoints. `form`: the initial form (default:
        a fact pair of the bundled model); `hooks`: the hooks offered; `params`: parameters
        (e.g. `layers="0-3"`), set after the form."""
        super().__init__(**{k: v for k, v in params.items() if k == "name"})
        self.client, self._owns_client = async_client(client_or_url, api_key)
        self.param.hooks.objects = list(hooks)
        self.set_form(form or default_form())
        self.param.update(**{k: v for k, v in params.items() if k != "name"})  # explicit fields win over the form
        self.state = SweepState()
        self.heatmaps: dict[str, SweepHeatmap] = {}
        self._events: list[tuple[int, str, Any]] = []  # (generation, kind, payload), filled by the stream task
        self._generation = 0
        self._request: dict | None = None  # the shown sweep's request (base of zooms)
        self._task: asyncio.Task | None = None  # the stream (or summary fetch) task
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop the tasks run on
        self._fetching = False  # fetching a cancelled sweep's final summary
        self._replaying = False
        self._selected_hook: str | None = None
        self._flusher = None  # a served page's periodic callback
        self._flush_task: asyncio.Task | None = None  # elsewhere: the view's own periodic fold
        self._heatmaps_pushed_at = 0.0
        self._closed = False
        self._doc = pn.state.curdoc if pn.state.curdoc is not None and pn.state.curdoc.session_context else None
        self.status_html = status_html(self.state, self.phase)
        self._layout = self._build_layout()
        # in a notebook cell: the browser's copy of the view kept in step (app/dashboard/notebook.py)
        self.browser = BrowserSync(self._layout)
        if self._doc is not None:  # a served page: its session's end cleans up
            pn.state.on_session_destroyed(self._on_session_destroyed)
        else:  # a notebook kernel or a script: the interpreter's exit does
            _LIVE_VIEWS.add(self)

    def __panel__(self) -> pn.viewable.Viewable:
        return self._layout

    # ---- the form ----------------------------------------------------------------------------
    def form(self) -> SweepForm:
        """The form's current values."""
        return SweepForm(
            clean_prompt=self.clean_prompt, corrupt_prompt=self.corrupt_prompt, corruption=self.corruption,
            subject=self.subject, noise_span=self.noise_span, noise_scale=float(self.noise_scale),
            noise_samples=int(self.noise_samples), noise_seed=int(self.noise_seed), answer=self.answer, foil=self.foil,
            layers=self.layers, positions=self.positions, hooks=list(self.hooks), metric=self.metric,
            alpha=float(self.alpha), max_concurrency=int(self.max_concurrency),
        )

    def set_form(self, f: SweepForm) -> None:
        """Fill the form (e.g. with another model's default pair)."""
        self.param.update(
            corruption=f.corruption, clean_prompt=f.clean_prompt, corrupt_prompt=f.corrupt_prompt, subject=f.subject,
            noise_span=f.noise_span, noise_scale=f.noise_scale, noise_samples=f.noise_samples, noise_seed=f.noise_seed,
            answer=f.answer, foil=f.foil, layers=f.layers, positions=f.positions, metric=f.metric, alpha=f.alpha,
            max_concurrency=f.max_concurrency,
            hooks=[h for h in f.hooks if h in self.param.hooks.objects] or [self.param.hooks.objects[-1]],
        )

    def set_hooks(self, hooks: Iterable[str]) -> None:
        """Offer `hooks` (e.g. the server's, from `GET /v1/status`); keeps the selected ones it
        still offers (else selects the last)."""
        hooks = list(hooks)
        if not hooks:
            return
        kept = [h for h in self.hooks if h in hooks] or [hooks[-1]]
        self.param.hooks.objects = hooks
        self.hooks = kept

    # ---- actions -----------------------------------------------------------------------------
    @param.depends("run_sweep", watch=True)
    def run_form(self) -> None:
        """Start a sweep of the form (the Run button); a bad field is shown, not sent."""
        try:
            request = self.form().to_request()
        except SpecError as exc:
            self.error = f"{exc.field}: {exc.message}"
            return
        self.start(request)

    def start(self, request: dict, *, zoom: bool = False) -> None:
        """Stream a sweep of `request` (a `POST /v1/patch_sweep` body); cancels the running one.
        A non-zoom sweep first drops the clean run kept by the previous one."""
        self._stop_stream()
        self._generation += 1
        gen = self._generation
        drop = None
        if not zoom:
            drop = self.kept_run
        self.state = SweepState()
        self._request = dict(request)
        self._set_heatmaps({})
        self.param.update(phase="running", zoomed=zoom, error="", sweep_id=None, progress=0.0, result=None,
                          kept_run=self.kept_run if zoom else None)
        self._refresh_status()
        body = {**request, "stream": True, "keep_source": True}
        self._ensure_flusher()
        self._spawn(lambda: self._consume(body, gen, drop))

    @param.depends("cancel_sweep", watch=True)
    def cancel(self) -> None:
        """Cancel the running sweep: close its stream and cancel it on the server, then show the
        server's final summary of it (marked cancelled) once it is written."""
        if self.phase != "running":
            return
        sweep_id = self._stop_stream()
        self.phase = "cancelled"
        self._render()
        if sweep_id is not None:
            self._fetching = True
            gen = self._generation
            self._ensure_flusher()
            self._spawn(lambda: self._fetch_summary(sweep_id, gen))

    @param.depends("zoom_in", watch=True)
    def zoom(self) -> None:
        """Re-sweep the `selection` rectangle from the kept clean run."""
        if self.selection is None:
            self.error = "zoom: select cells first (drag a box over a heatmap with the box-select tool)"
            return
        if self._request is None or self.kept_run is None:
            self.error = ("zoom: the previous sweep's clean run is not kept on the server (it was cancelled or "
                          "failed); run a sweep first")
            return
        layers, positions = self.selection
        self.start(zoom_request(self._request, layers, positions, self.kept_run), zoom=True)

    def replay(self, events: Iterable[dict]) -> SweepState:
        """Show recorded events (a saved stream, or `[{"type": "summary", **summary}]` for a saved
        result) instead of a live sweep; cancels the running one. The kept run stays as it is
        (a recorded sweep's run may be long gone: never zoom from it). Returns the state."""
        self._stop_stream()
        self._generation += 1
        self.state = SweepState()
        self._request = None
        self._set_heatmaps({})
        self.param.update(phase="idle", zoomed=False, error="", sweep_id=None, progress=0.0, result=None)
        self._events = [(self._generation, _EVENT, dict(ev)) for ev in events]
        self._replaying = True
        try:
            self._flush()
        finally:
            self._replaying = False
        if self.state.finished:
            self.phase = self._end_phase()
            self._refresh_status()
        return self.state

    async def wait(self, timeout: float | None = None) -> SweepState:
        """Wait until the running sweep has ended (and, after a cancel, until its final summary
        is shown); returns `state`. Outside a served page the fold is (re)started here if it is
        not running, so waiting never depends on a callback someone else owns. On `timeout`,
        raises `TimeoutError` saying where the view stands (phase, cells, error)."""

        async def settled() -> None:
            while self.phase == "running" or self._fetching or self._has_pending():
                if self._doc is None:
                    self._ensure_flusher()
                await asyncio.sleep(FLUSH_MS / 1000)

        try:
            await asyncio.wait_for(settled(), timeout)
        except asyncio.TimeoutError:
            s = self.state
            raise TimeoutError(
                f"the sweep did not settle in {timeout} s: phase {self.phase!r}, sweep {s.sweep_id}, cells "
                f"{s.cells_done}/{s.cells_total}, finished {s.finished}, fetching {self._fetching}, "
                f"events buffered {len(self._events)}, error {self.error!r}") from None
        return self.state

    @property
    def running(self) -> bool:
        return self.phase == "running"

    async def aclose(self) -> None:
        """Cancel the running sweep, drop the kept clean run and close the client (when the view
        made it). The view is unusable afterwards."""
        if self._closed:
            return
        self._closed = True
        _LIVE_VIEWS.discard(self)
        sweep_id = self._stop_stream(notify_server=False)
        try:
            self._stop_flusher()
        except Exception as exc:  # a destroyed session may have dropped its callbacks already
            logger.debug("stopping the periodic callback: %r", exc)
        if sweep_id is not None:
            self.phase = "cancelled"
        run, self.kept_run = self.kept_run, None
        try:
            if sweep_id is not None:
                with contextlib.suppress(CausalboardError, httpx.HTTPError):
                    await self.client.cancel_sweep(sweep_id)
            if run is not None:
                with contextlib.suppress(CausalboardError, httpx.HTTPError):
                    await self.client.drop_source(run)
        finally:
            if self._owns_client:
                await self.client.aclose()

    # ---- the stream task (no Bokeh model is touched here) -------------------------------------
    async def _consume(self, body: dict, gen: int, drop: str | None) -> None:
        def push(kind: str, payload: Any = None) -> None:  # events of a replaced sweep are dropped here
            if gen == self._generation:
                self._events.append((gen, kind, payload))

        if gen != self._generation:
            return
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
                push(_EVENT, {"type": "warning", "message": f"zoom is off for this sweep: {exc.message}"})
                await self._stream({**body, "keep_source": False}, gen, push)
        except CausalboardError as exc:
            push(_FAILED, exc.message if exc.status else str(exc))
        except httpx.HTTPError as exc:
            push(_FAILED, f"connection to the API failed: {exc!r}")
        finally:
            push(_ENDED)

    async def _stream(self, body: dict, gen: int, push: Callable[..., None]) -> None:
        async with contextlib.aclosing(self.client.stream_sweep(**body)) as stream:
            async for ev in stream:
                if gen != self._generation:
                    return  # closing the stream cancels the sweep on the server
                push(_EVENT, ev)

    async def _fetch_summary(self, sweep_id: str, gen: int) -> None:
        """After a cancel: follow the sweep's replay stream (`GET /v1/patch_sweep/{id}/events`)
        until the server has written its summary (marked cancelled); the fold takes it from there."""

        async def final_summary() -> dict | None:
            async with contextlib.aclosing(self.client.sweep_events(sweep_id)) as events:
                async for ev in events:
                    if ev.get("type") == "summary":
                        return ev
            return None

        try:
            summary = await asyncio.wait_for(final_summary(), SUMMARY_TIMEOUT_S)
            if summary is not None and gen == self._generation:
                self._events.append((gen, _EVENT, summary))
        except (CausalboardError, httpx.HTTPError, asyncio.TimeoutError) as exc:
            logger.warning("could not read the final summary of sweep %s: %s", sweep_id, exc)
        finally:
            self._fetching = False

    def _stop_stream(self, *, notify_server: bool = True) -> str | None:
        """Retire the current run (its events are no longer shown) and stop its task; a sweep
        still running is cancelled on the server too (`notify_server=False`: the caller does
        that). Returns the id of the sweep that was running (None when none was, or before its
        `start` event arrived)."""
        self._fold_pending()  # the start event may be waiting in the buffer: it names the sweep
        sweep_id = self.state.sweep_id if self.phase == "running" else None
        self._generation += 1
        self._fetching = False
        task, self._task = self._task, None
        if task is not None and not task.done():
            _cancel_task(task)
        if notify_server and sweep_id is not None and self._loop is not None and self._loop.is_running():
            # closing the stream makes the server cancel the sweep; say it explicitly too, so the
            # cells stop even if the disconnect is noticed late
            async def cancel_on_server() -> None:
                with contextlib.suppress(CausalboardError, httpx.HTTPError):
                    await self.client.cancel_sweep(sweep_id)

            asyncio.run_coroutine_threadsafe(cancel_on_server(), self._loop)
        return sweep_id

    def _spawn(self, make: Callable[[], Awaitable[Any]]) -> None:
        """Run `make()` as the view's task on its loop. Called from the loop itself (a notebook
        kernel, tests), from a Bokeh callback, or from a Bokeh worker thread (then the task is
        handed to the view's loop, or to the session's next tick)."""

        async def runner() -> None:
            self._loop = asyncio.get_running_loop()
            self._task = asyncio.current_task()
            await make()

        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if loop is not None:
            self._task = loop.create_task(runner())
        elif self._loop is not None and self._loop.is_running():
            asyncio.run_coroutine_threadsafe(runner(), self._loop)
        elif self._doc is not None:
            from panel.io.state import set_curdoc

            with set_curdoc(self._doc):
                pn.state.execute(runner)
        else:
            raise RuntimeError("TracingView needs a running event loop (a notebook kernel, a served page or "
                               "an async function)")

    # ---- folding and showing (periodic callback; holds the Bokeh document lock when served) ----
    def _ensure_flusher(self) -> None:
        """Make sure `_flush` runs every `FLUSH_MS` until the run has settled. A served page uses
        its session's periodic callback (it holds the document lock). Elsewhere — a notebook
        kernel, a script, a test — it is the view's own asyncio task on the running loop, not
        Panel's periodic callback: that one's task dies silently on an exception while still
        saying `running`, and it follows whichever document Panel holds as current."""
        if self._doc is not None:
            if self._flusher is None or not self._flusher.running:
                from panel.io.state import set_curdoc

                with set_curdoc(self._doc):
                    self._flusher = pn.state.add_periodic_callback(self._flush, period=FLUSH_MS, start=True)
            return
        if self._flush_task is not None and not self._flush_task.done():
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # a worker thread: start it on the view's loop
            if self._loop is not None and self._loop.is_running():
                self._loop.call_soon_threadsafe(self._ensure_flusher)
            return
        self._flush_task = loop.create_task(self._flush_loop(), name="tracing-view-flush")

    async def _flush_loop(self) -> None:
        while True:
            await asyncio.sleep(FLUSH_MS / 1000)
            if not self._flush():
                return

    def _stop_flusher(self) -> None:
        if self._flusher is not None:
            self._flusher.stop()
        task, self._flush_task = self._flush_task, None
        if task is not None and not task.done():
            try:
                current = asyncio.current_task()
            except RuntimeError:
                current = None
            if task is not current:  # the loop itself returns after this flush
                _cancel_task(task)

    def _has_pending(self) -> bool:
        return any(g == self._generation for g, _k, _p in self._events)

    def _flush(self) -> bool:
        """Fold and show what the stream task buffered; stop the periodic fold once the run has
        settled. Never raises: a failure to show is logged and put in `error`, and the fold goes
        on (a dead fold would leave the view `running` for ever). Returns whether to go on."""
        self._fold_pending()
        try:
            self._render()
        except Exception as exc:
            logger.exception("tracing view: showing the sweep failed")
            self.error = f"showing the sweep failed: {type(exc).__name__}: {exc}"
        if self.phase != "running" and not self._fetching and not self._has_pending():
            self._stop_flusher()
            return False
        return True

    def _fold_pending(self) -> None:
        """Fold the buffered events of the current run into `state` (pure: no Bokeh model is
        touched) and move `phase` when its stream ended or failed."""
        pending, self._events = self._events, []
        for gen, kind, payload in pending:
            if gen != self._generation:
                continue
            if kind == _ENDED:
                if self.phase == "running":
                    if not self.state.finished and not self.state.errors and not self.error:
                        self.error = "the sweep's stream ended without a summary"
                    self.phase = self._end_phase()
            elif kind == _FAILED:
                self.error = payload
                if self.phase == "running":
                    self.phase = "failed"
            else:
                try:
                    folded = self.state.apply(payload)
                    if isinstance(folded, SummaryEvent):
                        self._on_summary(folded)
                except SweepEventError as exc:
                    self.error = f"malformed sweep event: {exc}"
                except Exception as exc:  # one event must not lose the ones after it (the end of the stream)
                    logger.exception("tracing view: folding a sweep event failed")
                    self.error = f"folding a sweep event failed: {type(exc).__name__}: {exc}"

    def _end_phase(self) -> str:
        """The phase a run ends in, from what its events said."""
        s = self.state
        if s.errors or (self.error and not s.finished):
            return "failed"
        if s.finished:
            return "cancelled" if s.cancelled else "done"
        return "cancelled" if self.phase == "cancelled" else "failed"

    def _on_summary(self, summary: SummaryEvent) -> None:
        if self.phase == "running":
            self.phase = self._end_phase()
        if self._replaying:
            return
        kept = summary.source_kept
        if kept is None:  # servers without the field: kept when auto-captured and not cancelled
            kept = summary.auto_captured and not summary.cancelled
        new = summary.captured_source_run if kept else None
        if new and self.kept_run and new != self.kept_run:
            self._drop_later(self.kept_run)
        if new:
            self.kept_run = new
        elif not self.zoomed:
            self.kept_run = None

    def _render(self) -> None:
        """Show the fold: rebuild the heatmaps when the axes changed, push changed cells, and
        update the run parameters and the status."""
        s = self.state
        rebuilt = s.axes_changed
        if rebuilt:
            s.axes_changed = False
            self._set_heatmaps({hook: SweepHeatmap.from_result(s.result, hook, zoom=self.zoomed)
                                for hook in s.result.hooks})
            self.param.export_hook.objects = list(s.result.hooks)
            self.export_hook = s.result.hooks[0]
        now = time.monotonic()
        if rebuilt or self.phase != "running" or now - self._heatmaps_pushed_at >= HEATMAP_PUSH_MS / 1000:
            self._heatmaps_pushed_at = now
            self._push_cells()
        if s.result is not self.result:
            self.result = s.result
        self.param.update(sweep_id=s.sweep_id, progress=s.fraction_done)
        self._refresh_status()
        if self._doc is None:
            self.browser.changed()

    def _push_cells(self) -> None:
        """THE way cells reach the browser: the cells the fold changed since the last push, one
        `ColumnDataSource` update per heatmap."""
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

    def _refresh_status(self) -> None:
        self.status_html = status_html(self.state, self.phase, zoomed=self.zoomed, kept_run=self.kept_run)
        r = self.state.result
        self._key.object = legend_html(noise_threshold(r.meta) if r is not None else None)

    def _set_heatmaps(self, heatmaps: dict[str, SweepHeatmap]) -> None:
        self.heatmaps = heatmaps
        self._selected_hook = None
        self.selection = None
        for hook, hm in heatmaps.items():
            hm.source.selected.on_change("indices", self._selection_watcher(hook, hm))
        self._maps.objects = [pn.pane.Bokeh(hm.figure) for hm in heatmaps.values()] or [self._maps_hint]

    def _selection_watcher(self, hook: str, hm: SweepHeatmap) -> Callable[[str, Any, Any], None]:
        def on_select(_attr: str, _old: Any, new: Any) -> None:
            if self.heatmaps.get(hook) is not hm:
                return  # a replaced figure
            block = block_of(new or [], hm.layers, hm.positions)
            if block is not None:
                self._selected_hook, self.selection = hook, block
            elif self._selected_hook == hook:
                self._selected_hook, self.selection = None, None

        return on_select

    # ---- layout ------------------------------------------------------------------------------
    def _build_layout(self) -> pn.viewable.Viewable:
        w = pn.widgets
        full, half, third = dict(width=380), dict(width=185), dict(width=120)
        noise = pn.bind(lambda c: c == NOISE_SPAN, self.param.corruption)
        pairs = pn.bind(lambda c: c != NOISE_SPAN, self.param.corruption)
        clean_label = pn.bind(lambda c: "Prompt (gets noise on the span)" if c == NOISE_SPAN else "Clean prompt",
                              self.param.corruption)
        self.b_run = w.Button.from_param(self.param.run_sweep, label="Run sweep", color="primary", width=120,
                                         description=_tooltip_above(self.param.run_sweep.doc))
        self.b_cancel = w.Button.from_param(self.param.cancel_sweep, label="Cancel", color="warning", width=120,
                                            description=_tooltip_above(self.param.cancel_sweep.doc),
                                            disabled=pn.bind(lambda phase: phase != "running", self.param.phase))
        self.b_zoom = w.Button.from_param(
            self.param.zoom_in, label="Zoom into selection", width=250,
            description=_tooltip_above("Drag a box over a heatmap, then re-sweep every layer × position inside it"),
            disabled=pn.bind(lambda phase, kept: phase == "running" or kept is None, self.param.phase, self.param.kept_run))
        form = pn.Column(
            w.RadioButtonGroup.from_param(self.param.corruption, **full),
            w.TextInput.from_param(self.param.clean_prompt, label=clean_label, **full),
            w.TextInput.from_param(self.param.corrupt_prompt, label="Corrupt prompt", visible=pairs, **full),
            w.TextInput.from_param(self.param.subject, label="Subject in the corrupt prompt (marked *; optional)",
                                   visible=pairs, **full),
            w.TextInput.from_param(self.param.noise_span, label="Noise span (text in the prompt)", visible=noise, **full),
            pn.Row(w.FloatInput.from_param(self.param.noise_scale, label="Noise scale (× emb. std)", step=0.5,
                                           description=None, visible=noise, **third),
                   w.IntInput.from_param(self.param.noise_samples, label="Noise samples", visible=noise, **third),
                   w.IntInput.from_param(self.param.noise_seed, label="Noise seed", visible=noise, **third)),
            pn.Row(w.TextInput.from_param(self.param.answer, label="Answer (one token, verbatim)", **half),
                   w.TextInput.from_param(self.param.foil, label="Foil (one token)", **half)),
            pn.Row(w.TextInput.from_param(self.param.layers, label="Layers", placeholder="all | 0-5 | 0,2,4 | 0:6:2", **half),
                   w.TextInput.from_param(self.param.positions, label="Positions", placeholder="all | 1-3 | span:Garrow", **half)),
            w.CheckButtonGroup.from_param(self.param.hooks, label="Hooks", **full),
            pn.Row(w.Select.from_param(self.param.metric, label="Metric", **half),
                   w.FloatInput.from_param(self.param.alpha, label="alpha: (1−α)·h + α·clean", step=0.1, **half)),
            w.IntInput.from_param(self.param.max_concurrency, label="Cells in flight", **half),
            pn.Row(self.b_run, self.b_cancel), self.b_zoom,
            pn.pane.Alert(pn.bind(html.escape, self.param.error), alert_type="danger",
                          visible=pn.bind(bool, self.param.error), width=380),
            width=400, min_width=400,
        )
        downloads = [w.FileDownload(label=label, callback=self._exporter(fmt), embed=False, width=118,
                                    filename=pn.bind(self._download_name, fmt, self.param.result, self.param.export_hook),
                                    disabled=pn.bind(lambda r: r is None, self.param.result))
                     for label, fmt in EXPORTS]
        export = pn.FlexBox(w.Select.from_param(self.param.export_hook, label="Figure of hook", width=150), *downloads,
                            flex_wrap="wrap", align_items="flex-end", gap="6px", sizing_mode="stretch_width")
        self._key = pn.pane.HTML(legend_html(), sizing_mode="stretch_width", min_height=30)
        self._maps_hint = pn.pane.HTML('<p style="color:#666">Run a sweep to see one heatmap per hook.</p>')
        self._maps = pn.FlexBox(self._maps_hint, flex_wrap="wrap", gap="8px", sizing_mode="stretch_width")
        results = pn.Column(
            pn.indicators.Progress(value=pn.bind(lambda p: int(1000 * p), self.param.progress), max=1000,
                                   sizing_mode="stretch_width", height=14, bar_color="primary"),
            pn.pane.HTML(self.param.status_html, sizing_mode="stretch_width"),
            self._key, self._maps, pn.pane.HTML("<b>Export</b>"), export,
            sizing_mode="stretch_width", min_width=600)
        self.downloads = downloads
        return pn.Row(form, results, sizing_mode="stretch_width")

    # ---- export ------------------------------------------------------------------------------
    @staticmethod
    def _figure_hook(result: SweepResult | None, hook: str | None) -> str | None:
        """The hook the figure downloads draw: `export_hook` when it is one of the result's."""
        if result is None:
            return None
        return hook if hook in result.hooks else result.hooks[0]

    def _download_name(self, fmt: str, result: SweepResult | None, hook: str | None) -> str:
        sweep_id = result.meta.get("sweep_id") if result is not None else None
        return export_filename(export_stem(sweep_id), fmt, self._figure_hook(result, hook))

    def _exporter(self, fmt: str) -> Callable[[], io.BytesIO]:
        def produce() -> io.BytesIO:
            r = self.state.result
            if r is None:
                raise RuntimeError("no sweep to export yet")
            return io.BytesIO(export_payload(r, fmt, self._figure_hook(r, self.export_hook),
                                             export_stem(r.meta.get("sweep_id"))))

        return produce

    # ---- lifecycle ---------------------------------------------------------------------------
    def _drop_later(self, run_id: str) -> None:
        async def drop() -> None:
            with contextlib.suppress(CausalboardError, httpx.HTTPError):
                await self.client.drop_source(run_id)

        with contextlib.suppress(RuntimeError):  # no loop to run it on: nothing to drop from
            self._spawn_detached(drop())

    def _spawn_detached(self, coro: Awaitable[Any]) -> None:
        """Run `coro` on the view's loop without making it the view's task."""
        try:
            asyncio.get_running_loop().create_task(coro)
        except RuntimeError:
            if self._loop is None or not self._loop.is_running():
                coro.close()
                raise
            asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _on_session_destroyed(self, _session_context: Any) -> None:
        """The browser tab closed: cancel the sweep, drop the kept run, close the client."""
        with contextlib.suppress(RuntimeError):
            self._spawn_detached(self.aclose())

    def close_at_exit(self) -> None:
        """Synchronous clean-up for interpreter exit (no event loop runs any more): cancel the
        running sweep and drop the kept run on the server."""
        if self._closed:
            return
        self._closed = True
        sweep_id = self._stop_stream(notify_server=False)
        run = self.kept_run
        if sweep_id is None and run is None:
            return
        with contextlib.suppress(Exception), sync_twin(self.client) as client:  # exiting: best effort
            if sweep_id is not None:
                client.cancel_sweep(sweep_id)
            if run is not None:
                client.drop_source(run)


def _cancel_task(task: asyncio.Task) -> None:
    """Cancel `task` from any thread."""
    try:
        same_loop = asyncio.get_running_loop() is task.get_loop()
    except RuntimeError:
        same_loop = False
    if same_loop:
        task.cancel()
    else:
        with contextlib.suppress(RuntimeError):  # its loop is closed: nothing runs it any more
            task.get_loop().call_soon_threadsafe(task.cancel)


#: views that may still hold a sweep or a kept run on a server (closed at interpreter exit)
_LIVE_VIEWS: "weakref.WeakSet[TracingView]" = weakref.WeakSet()
_EXIT_LOCK = threading.Lock()


@atexit.register
def _close_live_views() -> None:
    with _EXIT_LOCK:
        for view in list(_LIVE_VIEWS):
            view.close_at_exit()


__all__ = ["FLUSH_MS", "HEATMAP_PUSH_MS", "TracingView"]


def _tooltip_above(text: str):
    """A button's hover text, shown above it and gone as soon as the pointer leaves the button.
    Panel's default (right of the button, and interactive: it stays while the pointer is on it)
    put "Run sweep"'s text over the Cancel button beside it, so a pointer moving from one to the
    other landed on the text and Cancel could not be clicked (tests/test_dashboard_browser.py)."""
    from bokeh.models import Tooltip

    return Tooltip(content=text, position="top_center", attachment="above", interactive=False,
                   stylesheets=[":host { white-space: initial; max-width: 300px; }"])

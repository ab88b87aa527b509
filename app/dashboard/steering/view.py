"""The steering view: named or contrastive steering vectors, per-vector scale sliders and sites,
and live baseline-vs-steered generations side by side.

`SteeringView(client_or_url)` is a Panel component (`pn.viewable.Viewer`): the dashboard shell
puts it in its "Steering" tab, and a notebook cell displays it as is. Its state is declared
parameters (`prompt`, `max_tokens`, the builder's fields, `selected` vectors) plus one
`VectorControl` per selected vector (`scale`, `layer`, `hook`); tests and notebooks drive it by
setting those parameters.

Behaviour
---------
* Steering is **per request** (`interventions.steer` on `POST /v1/generate` with
  `stream: true`), never the server-wide steering: a slider move must not reset the prefix cache
  or change other users' generations (research notes, fork §1.6).
* A change of any scale / layer / hook re-runs the steered stream after `debounce_s`; a newer
  change cancels the pending or in-flight steered stream (closing it aborts the request in the
  engine). A change of the prompt or `max_tokens` re-runs both streams.
* All scales zero (or no vector selected) sends no intervention: the steered column then equals
  the baseline.
* Everything goes through `app.client.http.AsyncCausalboardClient` (HTTP only; made by
  `app.client.factory.async_client`, as the tracing view's). Work is scheduled on
  the running asyncio loop (the Bokeh server's, or the notebook kernel's); Panel applies the
  parameter/pane updates under the document lock. Without a running loop, call
  `await view.update()` / `await view.build_vector()` yourself.
* In a notebook cell, `browser` (`app.dashboard.notebook.BrowserSync`) takes the output's comms
  over as it is displayed: a slider move is handled on the kernel's main loop (where the streams
  run), not on the JupyterLab subshell thread that received it, and updates made before the
  browser opened the output (Run All) reach it in order.
"""

from __future__ import annotations

import asyncio
import html
import time
from typing import Any, Awaitable, Callable

import panel as pn
import param

from app.client.factory import async_client
from app.dashboard.notebook import BrowserSync, NotebookOutputs
from app.dashboard.steering.vectors import (CAPTURE_MODES, NORMALISATIONS, ContrastiveVector,
                      abuild_contrastive_vector, check_vector_name, contrast_defaults,
                      parse_prompt_lines, steer_entry, steering_interventions)
from engine_ext.bundled import bundled_tasks
from engine_ext.sites import HOOKS, Site

KINDS = ("baseline", "steered")

_STYLE = """
.cb-gen {font-family: ui-monospace, monospace; white-space: pre-wrap; border: 1px solid #ddd;
         border-radius: 4px; padding: 8px; min-height: 4em; background: #fafafa}
.cb-gen .cb-prompt {color: #666}
.cb-gen .cb-out {color: #111; font-weight: 600}
.cb-meta {color: #555; font-size: 0.9em}
"""


def _fmt(x: float | None, digits: int = 3) -> str:
    return "?" if x is None else f"{x:.{digits}g}"


class VectorControl(param.Parameterized):
    """Scale and site of one selected named vector (a row of sliders in the view)."""

    scale = param.Number(default=0.0, doc="multiplier of the vector (0 = not steering)")
    layer = param.Selector(default=0, objects=[0], doc="decoder layer the vector is added at")
    hook = param.Selector(default="post_block", objects=list(HOOKS), doc="hook: residual stream or MLP branch (see docs/concepts.md)")

    def __init__(self, vector_name: str, *, dim: int | None, norm: float | None, layers: list[int], layer: int,
                 hook: str, scale_limit: float, **params: Any):
        super().__init__(**params)
        self.vector_name = vector_name
        self.dim = dim
        self.norm = norm
        self.param.layer.objects = list(layers)
        self.layer = layer if layer in layers else layers[-1]
        self.hook = hook
        self.slider = pn.widgets.FloatSlider.from_param(
            self.param.scale, label=f"scale · {vector_name}", start=-scale_limit, end=scale_limit,
            step=scale_limit / 40, width=300, css_classes=["cb-scale-slider"])
        self.layer_select = pn.widgets.Select.from_param(self.param.layer, label="layer", width=70)
        self.hook_select = pn.widgets.Select.from_param(self.param.hook, label="hook", width=110)
        self.info = pn.pane.HTML(self._info_html(), stylesheets=[_STYLE])
        self.param.watch(lambda _e: self.refresh_info(), ["scale", "layer", "hook"])

    def refresh_info(self) -> None:
        self.info.object = self._info_html()

    @property
    def site(self) -> str:
        return str(Site(int(self.layer), self.hook))

    @property
    def scale_value(self) -> float:
        """The scale as a float, rounded to 1e-6 (keyboard steps of 0.1 add up to 1e-16, not 0)."""
        return round(float(self.scale), 6)

    def entry(self) -> dict:
        """The per-request steer entry (registered vector by name, all positions, both phases)."""
        return steer_entry(self.site, name=self.vector_name, scale=self.scale_value)

    def describe(self) -> str:
        added = abs(self.scale_value) * self.norm if self.norm is not None else None
        return (f"{self.vector_name} @ {self.site} × {self.scale_value:+.2f} "
                f"(|v| = {_fmt(self.norm)}, added norm {_fmt(added)})")

    def set_scale_limit(self, limit: float) -> None:
        self.slider.param.update(start=-limit, end=limit, step=limit / 40)
        self.scale = max(-limit, min(limit, float(self.scale)))

    def _info_html(self) -> str:
        return f"<div class='cb-meta'>{html.escape(self.describe())}" + (f", dim {self.dim}" if self.dim else "") + "</div>"

    def __panel__(self) -> pn.viewable.Viewable:
        return pn.Column(self.info, self.slider, pn.Row(self.layer_select, self.hook_select), margin=(0, 0, 8, 0))


class SteeringView(NotebookOutputs, pn.viewable.Viewer):
    """Pick or build steering vectors, move their scales, watch baseline vs steered generations."""

    # ---- generation
    prompt = param.String(default="", doc="prompt generated from (baseline and steered)")
    max_tokens = param.Integer(default=16, bounds=(1, 128))
    debounce_s = param.Number(default=0.25, bounds=(0.0, 5.0), doc="quiet time after a control change before re-running")
    scale_limit = param.Number(default=4.0, bounds=(0.1, 1000.0), doc="the scale sliders run from -limit to +limit")
    selected = param.ListSelector(default=[], objects=[], doc="named vectors steering the steered column")

    # ---- contrastive builder
    prompts_a = param.String(default="", doc="set A, one prompt per line (the direction points towards A)")
    prompts_b = param.String(default="", doc="set B, one prompt per line")
    build_layer = param.Selector(default=2, objects=[2])
    build_hook = param.Selector(default="post_block", objects=list(HOOKS))
    build_positions = param.Selector(default="last_prompt", objects=list(CAPTURE_MODES))
    normalisation = param.Selector(default="none", objects=list(NORMALISATIONS))
    vector_name = param.String(default="")

    # ---- outputs (read-only for users; set by the streams)
    baseline_text = param.String(default="")
    steered_text = param.String(default="")
    baseline_status = param.String(default="")
    steered_status = param.String(default="")
    build_status = param.String(default="")
    model_info = param.String(default="")

    def __init__(self, client_or_url: Any = None, *, api_key: str | None = None, tasks: dict | None = None,
                 autostart: bool = True, **params: Any):
        """`client_or_url`: an `AsyncCausalboardClient` (used as is, not closed by the view), a
        sync `CausalboardClient` or a base URL (default `$CAUSALBOARD_URL`, else
        http://127.0.0.1:8000; the view makes and owns an async client, with `api_key`).
        `tasks`: a tasks.json dict for the default prompt sets (default: the bundled model's).
        `autostart`: fetch the server's layers and vectors and run both streams once loaded
        (in a served page: when the session has loaded; elsewhere: now, on the running loop)."""
        defaults = contrast_defaults(tasks if tasks is not None else bundled_tasks())
        params.setdefault("prompt", defaults.test_prompt)
        params.setdefault("prompts_a", "\n".join(defaults.prompts_a))
        params.setdefault("prompts_b", "\n".join(defaults.prompts_b))
        params.setdefault("vector_name", defaults.name)
        super().__init__(**params)
        self.build_layer, self.build_hook = defaults.layer, defaults.hook
        self.param.build_layer.objects = [defaults.layer]
        self.client, self._owns_client = async_client(client_or_url, api_key)
        self.controls: dict[str, VectorControl] = {}
        self.vector_info: dict[str, dict] = {}      #: name -> {"dim", "norm"} from the server
        self.built: dict[str, ContrastiveVector] = {}  #: vectors built in this view, by name
        self.layers: list[int] = [defaults.layer]
        self.last_steer: dict | None = None         #: interventions of the latest steered stream
        self._shown_prompt = {k: "" for k in KINDS}
        self._tasks: dict[str, asyncio.Task | None] = {}   #: key -> the task running (or last run) under it
        self._tokens: dict[str, object] = {}              #: key -> the latest request to run under it
        self._loop: asyncio.AbstractEventLoop | None = None
        self._doc = pn.state.curdoc if pn.state.curdoc is not None and pn.state.curdoc.session_context else None
        self._runs = {k: 0 for k in KINDS}
        self._build_layout()
        # in a notebook cell: the browser's copy of the view kept in step (app/dashboard/notebook.py)
        self.browser = BrowserSync(self._layout)
        self.param.watch(self._on_generation_input, ["prompt", "max_tokens"])
        self.param.watch(self._on_selected, ["selected"])
        self.param.watch(self._on_scale_limit, ["scale_limit"])
        self.param.watch(self._render_output, ["baseline_text", "steered_text", "baseline_status", "steered_status"])
        if autostart:
            if self._doc is not None:
                pn.state.onload(self._start)
                pn.state.on_session_destroyed(lambda _ctx: self._spawn("close", self.aclose))
            else:
                self._start()

    # ---- public API ---------------------------------------------------------------------------
    async def refresh(self) -> None:
        """Fetch the model's layers and the registered vectors from the server."""
        status = await self.client.status()
        n_layers = int(status.get("num_layers") or len(self.layers))
        self.layers = list(range(n_layers))
        self.param.build_layer.objects = self.layers
        if self.build_layer not in self.layers:
            self.build_layer = self.layers[-1]
        for ctrl in self.controls.values():
            ctrl.param.layer.objects = self.layers
        self.model_info = f"{status.get('model', '?')} · {n_layers} layers · hidden {status.get('hidden_size', '?')}"
        await self.refresh_vectors()

    async def refresh_vectors(self) -> None:
        """Re-read `GET /v1/steering/vectors`; drops selections of vectors that vanished."""
        self.vector_info = _vector_infos(await self.client.list_vectors())
        names = sorted(self.vector_info)
        self.param.selected.objects = names
        kept = [n for n in self.selected if n in self.vector_info]
        if kept != list(self.selected):
            self.selected = kept
        for name, ctrl in self.controls.items():
            info = self.vector_info.get(name, {})
            ctrl.norm, ctrl.dim = info.get("norm", ctrl.norm), info.get("dim", ctrl.dim)
            ctrl.refresh_info()

    async def build_vector(self) -> ContrastiveVector:
        """Capture the builder's site for every prompt of A and B, register mean(A) − mean(B)
        (normalised) under `vector_name`, select it and re-run the steered stream."""
        self.build_status = "capturing…"
        try:
            name = check_vector_name(self.vector_name)
            a = parse_prompt_lines(self.prompts_a, "prompts_a")
            b = parse_prompt_lines(self.prompts_b, "prompts_b")
            site = str(Site(int(self.build_layer), self.build_hook))
            t0 = time.monotonic()
            cv = await abuild_contrastive_vector(self.client, a, b, site, positions=self.build_positions,
                                                 normalisation=self.normalisation, name=name, register=True)
        except Exception as exc:  # shown in the view, re-raised for callers
            self.build_status = f"<span style='color:#b00'>{html.escape(_error_text(exc))}</span>"
            raise
        self.built[name] = cv
        if name in self.controls:  # a rebuilt vector keeps its slider but takes its new site
            self.controls[name].layer, self.controls[name].hook = int(self.build_layer), self.build_hook
        await self.refresh_vectors()
        self.vector_info.setdefault(name, {"dim": int(cv.vector.shape[0]), "norm": cv.norm})
        if name in self.controls:
            self.controls[name].norm = cv.norm
            self.controls[name].refresh_info()
            self._schedule("steered", 0.0)
        if name not in self.selected:
            self.selected = [*self.selected, name]
        self.build_status = (f"registered <b>{html.escape(name)}</b> at {site} ({cv.positions}, "
                             f"{len(a)} vs {len(b)} prompts, {time.monotonic() - t0:.1f} s): |v| = {cv.norm:.4g} "
                             f"(raw {cv.raw_norm:.4g}, mean activation norm {cv.activation_norm:.4g}, "
                             f"normalisation {cv.normalisation})")
        return cv

    def interventions(self) -> dict | None:
        """The per-request interventions the steered column uses now (None = plain generation)."""
        return steering_interventions(self.controls[n].entry() for n in self.selected if n in self.controls)

    async def update(self) -> tuple[str, str]:
        """Re-run both streams now and wait for them; returns (baseline, steered) text."""
        self._schedule("baseline", 0.0)
        self._schedule("steered", 0.0)
        await self.wait_idle()
        return self.baseline_text, self.steered_text

    async def wait_idle(self, timeout: float = 300.0) -> None:
        """Wait until no stream, build or start-up task is pending, including ones scheduled
        while waiting (call it on the view's loop; work handed over from Bokeh worker threads
        counts once it has started)."""
        deadline = time.monotonic() + timeout
        while True:
            pending = [t for t in self._tasks.values() if t is not None and not t.done()]
            if not pending:
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the steering view did not become idle")
            await asyncio.wait(pending, timeout=left)

    async def ready(self) -> None:
        """Wait for the start-up (refresh + first generations) to finish."""
        await self.wait_idle()

    def runs(self, kind: str) -> int:
        """How many `kind` streams finished so far (a cancelled one does not count)."""
        return self._runs[kind]

    async def aclose(self) -> None:
        """Cancel every stream and close the client when the view made it."""
        self._tokens.clear()
        for key, task in list(self._tasks.items()):
            if key != "close" and task is not None and not task.done():
                self._cancel(task)
        if self._owns_client:
            await self.client.aclose()

    # ---- scheduling -----------------------------------------------------------------------------
    def _start(self) -> None:
        self._spawn("startup", self._startup)

    async def _startup(self) -> None:
        try:
            await self.refresh()
        except Exception as exc:  # the server may be down: say so, keep the view usable
            self.baseline_status = f"cannot reach the server: {_error_text(exc)}"
            return
        self._schedule("baseline", 0.0)
        self._schedule("steered", 0.0)

    def _spawn(self, key: str, make: Callable[[], Awaitable[Any]]) -> None:
        """Run `make()` as the task under `key`, cancelling the previous one (pending or running).

        Called from the loop itself (notebook kernel, tests) or from a Bokeh worker thread: the
        Bokeh server runs document callbacks (watchers, onload) in a thread pool, so the task is
        then handed to the view's loop (known once a task ran) or to the session's next tick
        (`pn.state.execute`, without the document lock)."""
        token = object()
        self._tokens[key] = token
        old = self._tasks.get(key)
        if old is not None and not old.done():
            self._cancel(old)

        async def runner() -> None:
            if self._tokens.get(key) is not token:
                return  # superseded before it started
            self._loop = asyncio.get_running_loop()
            self._tasks[key] = asyncio.current_task()
            await make()

        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if loop is not None:
            self._tasks[key] = loop.create_task(runner())
        elif self._loop is not None and self._loop.is_running():
            asyncio.run_coroutine_threadsafe(runner(), self._loop)
        elif self._doc is not None:
            from panel.io.state import set_curdoc

            with set_curdoc(self._doc):
                pn.state.execute(runner)
        # else: no loop at all (plain script): the caller awaits update()/build_vector() itself

    def _cancel(self, task: asyncio.Task) -> None:
        try:
            same_loop = asyncio.get_running_loop() is task.get_loop()
        except RuntimeError:
            same_loop = False
        if same_loop:
            task.cancel()
        else:
            task.get_loop().call_soon_threadsafe(task.cancel)

    def _schedule(self, kind: str, delay: float) -> None:
        self._spawn(kind, lambda: self._stream(kind, delay))

    def _on_generation_input(self, _event: Any) -> None:
        self._schedule("baseline", self.debounce_s)
        self._schedule("steered", self.debounce_s)

    def _on_control(self, _event: Any) -> None:
        self._schedule("steered", self.debounce_s)

    def _on_scale_limit(self, event: Any) -> None:
        for ctrl in self.controls.values():
            ctrl.set_scale_limit(float(event.new))

    def _on_selected(self, event: Any) -> None:
        for name in event.new:
            if name not in self.controls:
                self.controls[name] = self._make_control(name)
        self._controls_box.objects = [self.controls[n] for n in event.new] or [self._no_vector_hint]
        self._browser_changed()
        self._schedule("steered", 0.0)

    def _make_control(self, name: str) -> VectorControl:
        info = self.vector_info.get(name, {})
        cv = self.built.get(name)
        layer, hook = (int(self.build_layer), self.build_hook)
        if cv is not None:
            layer, hook = int(cv.site[1:cv.site.index(".")]), cv.site.split(".", 1)[1]
        ctrl = VectorControl(name, dim=info.get("dim"), norm=info.get("norm"), layers=self.layers, layer=layer,
                             hook=hook, scale_limit=float(self.scale_limit))
        ctrl.param.watch(self._on_control, ["scale", "layer", "hook"])
        return ctrl

    # ---- streams --------------------------------------------------------------------------------
    async def _stream(self, kind: str, delay: float) -> None:
        """One generation into the `kind` column; cancelled by a newer one."""
        if delay > 0:
            await asyncio.sleep(delay)
        prompt, max_tokens = self.prompt, int(self.max_tokens)
        interventions = self.interventions() if kind == "steered" else None
        note = ""
        if kind == "steered":
            self.last_steer = interventions
            active = [self.controls[n] for n in self.selected if n in self.controls and self.controls[n].scale_value != 0.0]
            note = "; ".join(c.describe() for c in active) if active else "no steering (select a vector and move its scale)"
        self._shown_prompt[kind] = prompt
        self._set(kind, "", "streaming…" + (f" · {note}" if note else ""))
        text, t0 = "", time.monotonic()
        try:
            async for ev in self.client.stream_generate(prompt, max_tokens=max_tokens, interventions=interventions):
                etype = ev.get("type")
                if etype == "token":
                    text += ev.get("text", "")
                    self._set(kind, text, None)
                elif etype == "done":
                    text = ev.get("text", text)
                    result = ev.get("intervention") or {}
                    status = f"done in {time.monotonic() - t0:.2f} s, {len(ev.get('token_ids') or [])} tokens"
                    if result.get("status") == "voided":
                        status = "VOIDED (not a steered result): " + "; ".join(result.get("errors") or [])
                    self._set(kind, text, status + (f" · {note}" if note else ""))
                elif etype == "error":
                    self._set(kind, text, f"error: {ev.get('error') or ev}")
                    return
        except asyncio.CancelledError:
            self._set(kind, text, "superseded by a newer change")
            raise
        except Exception as exc:
            self._set(kind, text, f"error: {_error_text(exc)}")
            return
        self._runs[kind] += 1

    def _set(self, kind: str, text: str, status: str | None) -> None:
        self.param.update({f"{kind}_text": text, **({f"{kind}_status": status} if status is not None else {})})

    # ---- layout ---------------------------------------------------------------------------------
    def _build_layout(self) -> None:
        self._outputs = {k: pn.pane.HTML(self._output_html(k), stylesheets=[_STYLE], sizing_mode="stretch_width",
                                         css_classes=[f"cb-{k}-output"]) for k in KINDS}
        self._no_vector_hint = pn.pane.Markdown("*No vector selected: pick a registered vector above or build one below.*")
        self._controls_box = pn.Column(self._no_vector_hint)
        refresh = pn.widgets.Button(label="Refresh list", color="light", width=110)
        refresh.on_click(lambda _e: self._spawn("refresh", self.refresh_vectors))
        build = pn.widgets.Button(label="Capture & register", color="primary", width=170)
        build.on_click(lambda _e: self._spawn("build", self._build_clicked))
        regenerate = pn.widgets.Button(label="Regenerate", color="default", width=110)
        regenerate.on_click(lambda _e: self._on_generation_input(None))
        w = pn.widgets
        vectors_card = pn.Card(
            pn.Row(w.MultiChoice.from_param(self.param.selected, label="Named vectors", width=300), refresh),
            w.FloatInput.from_param(self.param.scale_limit, label="slider range ±", width=120),
            self._controls_box, title="Steering vectors", collapsible=False, sizing_mode="stretch_width")
        builder_card = pn.Card(
            pn.pane.Markdown("Capture the residual stream at one site for each prompt, then register "
                             "**mean(A) − mean(B)**: steering with it pushes generations from B-like towards A-like."),
            w.TextAreaInput.from_param(self.param.prompts_a, label="A (one prompt per line)", height=130, sizing_mode="stretch_width"),
            w.TextAreaInput.from_param(self.param.prompts_b, label="B (one prompt per line)", height=130, sizing_mode="stretch_width"),
            pn.Row(w.Select.from_param(self.param.build_layer, label="layer", width=70),
                   w.Select.from_param(self.param.build_hook, label="hook", width=110),
                   w.Select.from_param(self.param.build_positions, label="positions", width=120),
                   w.Select.from_param(self.param.normalisation, label="normalise", width=110)),
            pn.Row(w.TextInput.from_param(self.param.vector_name, label="name", width=220), build),
            pn.pane.HTML(pn.bind(lambda status: f"<div data-cb='build-status'>{status}</div>", self.param.build_status),
                         stylesheets=[_STYLE]),
            title="Build from a contrastive pair", collapsed=False, sizing_mode="stretch_width")
        generation = pn.Column(
            pn.pane.HTML(self.param.model_info, stylesheets=[_STYLE]),
            pn.Row(w.TextInput.from_param(self.param.prompt, label="Prompt", sizing_mode="stretch_width"),
                   w.IntInput.from_param(self.param.max_tokens, label="max tokens", width=100), regenerate,
                   sizing_mode="stretch_width"),
            pn.Row(pn.Column(pn.pane.Markdown("#### Baseline"), self._outputs["baseline"], sizing_mode="stretch_width"),
                   pn.Column(pn.pane.Markdown("#### Steered"), self._outputs["steered"], sizing_mode="stretch_width"),
                   sizing_mode="stretch_width"),
            pn.pane.Markdown("Per-request steering (`interventions.steer` on `/v1/generate`): adds "
                             "scale · v to the residual stream at the vector's site, at every position "
                             "(sites, hooks and positions: `docs/concepts.md`)."),
            sizing_mode="stretch_width")
        self._layout = pn.Row(pn.Column(vectors_card, builder_card, width=480), generation, sizing_mode="stretch_width")

    async def _build_clicked(self) -> None:
        try:
            await self.build_vector()
        except Exception:
            pass  # already shown in build_status

    def _output_html(self, kind: str) -> str:
        text = getattr(self, f"{kind}_text")
        status = getattr(self, f"{kind}_status")
        return (f"<div class='cb-gen'><span class='cb-prompt' data-cb='{kind}-prompt'>{html.escape(self._shown_prompt[kind])}</span>"
                f"<span class='cb-out' data-cb='{kind}-text'>{html.escape(text)}</span></div>"
                f"<div class='cb-meta' data-cb='{kind}-status'>{html.escape(status)}</div>")

    def _render_output(self, *events: Any) -> None:
        for kind in dict.fromkeys(e.name.split("_", 1)[0] for e in events):
            self._outputs[kind].object = self._output_html(kind)
        self._browser_changed()

    def _browser_changed(self) -> None:
        if self._doc is None:  # a notebook cell (a served page has no comm to keep in step)
            self.browser.changed()

    def __panel__(self) -> pn.viewable.Viewable:
        return self._layout


# ---- helpers --------------------------------------------------------------------------------------
def _vector_infos(payload: Any) -> dict[str, dict]:
    """`GET /v1/steering/vectors` (`{"named": [{"name", "dim", "norm"}], ...}`) as
    `{name: {"dim", "norm"}}`."""
    items = payload.get("named", []) if isinstance(payload, dict) else payload
    out: dict[str, dict] = {}
    for item in items or []:
        if isinstance(item, dict) and "name" in item:
            out[str(item["name"])] = {"dim": item.get("dim"), "norm": item.get("norm")}
    return out


def _error_text(exc: BaseException) -> str:
    message = getattr(exc, "message", None)
    field = getattr(exc, "field", None)
    if message and field and not str(message).startswith(f"{field}:"):
        return f"{field}: {message}"
    return str(message or exc) or type(exc).__name__

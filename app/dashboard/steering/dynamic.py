"""The dynamic-steering panel of the steering tab: steer only when a probe fires, and see it.

`DynamicTraceView(client_or_url)` is a Panel component: its controls are declared parameters
(the probe, the policy's mode and thresholds, the steering vector and site); `run()` generates
from `prompt` with that policy (`POST /v1/generate`, streamed, with `dynamic`) and shows the text
with, under it, the strip plot of the trace: per generated token the probe's score, the
threshold and whether steering was engaged (shaded). The rows are `app.figures.dynamic_trace`'s,
so the screen shows what the exported figure shows. Tests and notebooks drive it by setting
parameters and awaiting `run()`. In a notebook cell its output's comms are taken over as it is
displayed (`app.dashboard.notebook.NotebookOutputs`: a click is handled on the kernel's main loop).
"""

from __future__ import annotations

import html
from typing import Any

import panel as pn
import param

from app.client.factory import async_client
from app.dashboard.notebook import NotebookOutputs
from app.figures.dynamic_trace import ENGAGED_FILL, SCORE_COLOR, THRESHOLD_COLOR, trace_rows
from app.figures.presentation import token_label
from engine_ext.sites import HOOKS, Site


class DynamicTraceView(NotebookOutputs, pn.viewable.Viewer):
    """Probe-gated / closed-loop steering of one generation, with its per-token trace."""

    prompt = param.String(default="The capital of Thaethas is")
    max_tokens = param.Integer(default=16, bounds=(1, 128))
    ignore_eos = param.Boolean(default=False, doc="keep generating after the end-of-sequence token")
    probe = param.Selector(default=None, objects=[None], doc="registered probe (GET /v1/steering/probes)")
    mode = param.Selector(default="threshold", objects=["threshold", "proportional"])
    on = param.Number(default=0.0, doc="threshold: engage when the score is >= on")
    off = param.Number(default=0.0, doc="threshold: release below off (<= on)")
    min_hold = param.Integer(default=0, bounds=(0, 128), doc="threshold: tokens to stay engaged at least")
    latch = param.Selector(default="none", objects=["none", "request"])
    target = param.Number(default=0.0, doc="proportional: the score to hold")
    gain = param.Number(default=0.1, doc="proportional: scale += gain * (target - score)")
    vector = param.Selector(default=None, objects=[None], doc="registered steering vector")
    scale = param.Number(default=1.0, doc="threshold: the scale while engaged")
    layer = param.Integer(default=2, bounds=(0, None))
    hook = param.Selector(default="post_attn", objects=list(HOOKS))

    # probe builder: two prompt sets -> a fitted probe (POST /v1/steering/probes/fit)
    fit_name = param.String(default="dashboard_probe", doc="name of the probe to fit")
    fit_positive = param.String(default="", doc="prompts the probe should score high, one per line")
    fit_negative = param.String(default="", doc="prompts of the other class, one per line")
    fit_layer = param.Integer(default=3, bounds=(0, None))
    fit_hook = param.Selector(default="post_block", objects=list(HOOKS))
    fit_method = param.Selector(default="mean_diff", objects=["mean_diff", "least_squares", "logistic"])
    fit_status = param.String(default="")

    # outputs
    text = param.String(default="")
    status = param.String(default="")
    rows = param.List(default=[], doc="the trace rows (app.figures.dynamic_trace.trace_rows)")
    determinism = param.Dict(default={}, doc="GET /v1/steering/dynamic's determinism after the last run")

    def __init__(self, client_or_url: Any = None, *, api_key: str | None = None, **params: Any):
        super().__init__(**params)
        self._client, self._owned = async_client(client_or_url, api_key=api_key)
        self._last: dict | None = None
        self.text_pane = pn.pane.HTML("", sizing_mode="stretch_width")
        self.plot_pane = pn.pane.Bokeh(None, sizing_mode="stretch_width")
        self.status_pane = pn.pane.HTML("")
        self.run_button = pn.widgets.Button(label="Generate with the policy", color="primary")
        self.run_button.on_click(lambda _e: pn.state.execute(self.run))
        self.fit_button = pn.widgets.Button(label="Fit the probe", color="default")
        self.fit_button.on_click(lambda _e: pn.state.execute(self.fit))

    async def refresh_choices(self) -> None:
        """Reload the probe and vector lists from the server."""
        probes = [p["name"] for p in await self._client.list_probes()]
        listing = await self._client.list_vectors()
        # causalboard's named vectors (`named`; `vectors` is the fork's probe/steer registry)
        vectors = sorted(v["name"] for v in listing.get("named") or [])
        self.param.probe.objects = [None, *probes]
        self.param.vector.objects = [None, *vectors]
        if self.probe not in probes:
            self.probe = probes[0] if probes else None
        if self.vector not in vectors:
            self.vector = vectors[0] if vectors else None

    async def fit(self) -> dict | None:
        """Fit a probe from the two prompt sets, register it, select it and set the thresholds to
        the fit's midpoint (`on`) and one score spread below (`off`)."""
        pos = [p.strip() for p in self.fit_positive.splitlines() if p.strip()]
        neg = [p.strip() for p in self.fit_negative.splitlines() if p.strip()]
        try:
            out = await self._client.fit_probe(name=self.fit_name, site=str(Site(int(self.fit_layer), self.fit_hook)),
                                               positive=pos, negative=neg, method=self.fit_method)
        except Exception as exc:
            self.fit_status = f"error: {exc}"
            return None
        await self.refresh_choices()
        scores = out["positive_scores"] + out["negative_scores"]
        spread = (max(scores) - min(scores)) / 4 if scores else 1.0
        self.param.update(probe=out["probe"]["name"], mode="threshold", on=out["threshold"], off=out["threshold"] - spread)
        self.fit_status = (f"fitted {out['probe']['name']} ({out['probe']['kind']}) at {out['probe']['site']}: "
                           f"threshold {out['threshold']:.3g}")
        return out

    def policy(self) -> dict:
        """The policy JSON the controls describe (`dynamic.policies[0]` of the request)."""
        site = str(Site(int(self.layer), self.hook))
        pol: dict = {"probe": self.probe, "mode": self.mode, "sites": [site], "vector_name": self.vector}
        if self.mode == "threshold":
            pol.update(on=float(self.on), off=float(self.off), min_hold=int(self.min_hold), scale=float(self.scale),
                       latch=self.latch)
        else:
            pol.update(target=float(self.target), gain=float(self.gain))
        return pol

    async def run(self) -> dict | None:
        """Generate with the policy; fill `text`, `rows`, the strip plot and `status`."""
        if self.probe is None or self.vector is None:
            self.status = "pick a probe and a steering vector (register them first)"
            self._render()
            return None
        pieces: list[str] = []
        done: dict | None = None
        try:
            async for ev in self._client.stream_generate(self.prompt, max_tokens=int(self.max_tokens),
                                                         ignore_eos=bool(self.ignore_eos),
                                                         dynamic={"policies": [self.policy()]}):
                if ev.get("type") == "token":
                    pieces.append(ev.get("text", ""))
                elif ev.get("type") == "done":
                    done = ev
                elif ev.get("type") == "error":
                    raise RuntimeError(ev.get("error"))
        except Exception as exc:  # a 400 names the field: show it, keep the view usable
            self.status = f"error: {exc}"
            self._render()
            return None
        self._last = done
        self.text = done.get("text", "")
        self.rows = trace_rows(done, 0, token_strings=pieces)
        iv = done.get("intervention") or {}
        engaged = sum(r["engaged"] for r in self.rows)
        self.status = f"{iv.get('status', '?')}: steering engaged on {engaged} of {len(self.rows)} tokens"
        try:  # the applied-action checksums across ranks (GET /v1/steering/dynamic)
            det = (await self._client.dynamic_status())["determinism"]
            self.determinism = det
            self.status += (f" · ranks consistent ({det['action_count']} actions)" if det.get("consistent")
                            else f" · RANKS DISAGREE: {det.get('checksums')}")
        except Exception as exc:
            self.status += f" · determinism unknown ({exc})"
        self._render()
        return done

    def _render(self) -> None:
        self.text_pane.object = (f"<div class='cb-gen' data-cb='dyn-text'><span style='color:#666'>{html.escape(self.prompt)}</span>"
                                 f"<b>{html.escape(self.text)}</b></div>")
        self.status_pane.object = f"<div class='cb-meta' data-cb='dyn-status'>{html.escape(self.status)}</div>"
        self.plot_pane.object = self.figure() if self.rows else None

    def figure(self):
        """The Bokeh strip plot of `rows` (the same rows and colours as the exported figure)."""
        from bokeh.models import ColumnDataSource
        from bokeh.plotting import figure

        rows = self.rows
        x = [r["index"] for r in rows]
        thr = [r["threshold"] if abs(r["threshold"]) < 1e15 else float("nan") for r in rows]
        src = ColumnDataSource({"x": x, "score": [r["score"] for r in rows], "threshold": thr,
                                "engaged": [1 if r["engaged"] else 0 for r in rows],
                                "token": [token_label(r["token"]) for r in rows]})
        scores = [r["score"] for r in rows] + [t for t in thr if t == t]
        lo, hi = min(scores), max(scores)
        pad = 0.1 * (hi - lo or 1.0)
        fig = figure(height=220, sizing_mode="stretch_width", y_range=(lo - pad, hi + pad), x_range=(-0.5, len(rows) - 0.5),
                     tools="hover", tooltips=[("token", "@token"), ("score", "@score"), ("threshold", "@threshold"),
                                              ("engaged", "@engaged")], toolbar_location=None)
        eng = ColumnDataSource({"x": [r["index"] for r in rows if r["engaged"]]})
        fig.vbar(x="x", width=1.0, top=hi + pad, bottom=lo - pad, source=eng, color=ENGAGED_FILL, alpha=0.8)
        fig.step(x="x", y="threshold", source=src, mode="center", color=THRESHOLD_COLOR, line_dash="dashed")
        fig.line(x="x", y="score", source=src, color=SCORE_COLOR, line_width=2)
        fig.scatter(x="x", y="score", source=src, color=SCORE_COLOR, size=5)
        fig.xaxis.ticker = x
        fig.xaxis.major_label_overrides = {i: t for i, t in zip(x, src.data["token"])}
        fig.xaxis.major_label_orientation = 1.0
        fig.yaxis.axis_label = "probe score"
        self._source = src
        return fig

    def __panel__(self) -> pn.viewable.Viewable:
        controls = pn.Param(self.param, parameters=["prompt", "max_tokens", "ignore_eos", "probe", "mode", "on", "off", "min_hold",
                                                    "latch", "target", "gain", "vector", "scale", "layer", "hook"],
                            show_name=False, width=300)
        builder = pn.Param(self.param, parameters=["fit_name", "fit_positive", "fit_negative", "fit_layer", "fit_hook",
                                                   "fit_method"], show_name=False, width=300,
                           widgets={"fit_positive": pn.widgets.TextAreaInput, "fit_negative": pn.widgets.TextAreaInput})
        fit_box = pn.Card(builder, self.fit_button, pn.widgets.StaticText.from_param(self.param.fit_status),
                          title="Fit a probe from two prompt sets", collapsed=True, width=320)
        return pn.Row(pn.Column(pn.pane.Markdown("### Dynamic steering"), fit_box, controls, self.run_button),
                      pn.Column(self.text_pane, self.plot_pane, self.status_pane, sizing_mode="stretch_width"),
                      sizing_mode="stretch_width")

    async def aclose(self) -> None:
        if self._owned:
            await self._client.aclose()

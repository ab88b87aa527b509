"""The dashboard page: a header (model, device, versions from `GET /v1/status`) and two tabs,
"Causal tracing" (`TracingView`) and "Steering" (`SteeringView` from `app/dashboard/steering/view.py`,
imported lazily; a placeholder explains why when it cannot be built; under it the dynamic-steering
panel, `DynamicTraceView` from `app/dashboard/steering/dynamic.py`, when it can be built).

`create_page(api_url)` builds one page per browser session (`mount` serves it at /dashboard);
the page only talks to the API at `api_url` over HTTP. When the server guards mutating
endpoints with an API key (`ask_api_key=True`), the page asks for the key before building the
views, so opening /dashboard does not bypass the key.
"""

from __future__ import annotations

import html
from typing import Any

import panel as pn

from engine_ext.bundled import BUNDLED_MODEL_NAME

from app.dashboard.tracing.form import default_form
from app.dashboard.tracing.view import TracingView

VERSION_ORDER = ("causalboard", "vllm", "torch", "transformers", "python")


def topology_text(topology: dict | None) -> str:
    """`TP 2 x PP 2 (stage 0: layers 0-3, stage 1: layers 4-7)`; empty for one rank."""
    if not topology:
        return ""
    tp, pp = int(topology.get("tensor_parallel_size", 1)), int(topology.get("pipeline_parallel_size", 1))
    if tp * pp <= 1:
        return ""
    stages = ", ".join(f"stage {s['pp_rank']}: layers {s['layers'][0]}-{s['layers'][1]}" for s in topology.get("stages", []))
    return f"TP {tp} x PP {pp}" + (f" ({stages})" if stages else "")


def header_html(status: dict | None, api_url: str, error: str | None = None) -> str:
    """The header line: model, device, dtype, layers, parallel topology, versions (escaped)."""
    e = html.escape
    if status is None:
        detail = f'<span style="color:#b00">API at {e(api_url)} unreachable: {e(error)}</span>' if error else "connecting…"
        return f'<div class="cb-header"><b style="font-size:18px">causalboard</b> · {detail}</div>'
    versions = status.get("versions") or {}
    names = [k for k in VERSION_ORDER if k in versions] + sorted(k for k in versions if k not in VERSION_ORDER)
    vtext = " · ".join(f"{e(k)} {e(str(versions[k]))}" for k in names)
    state = "" if status.get("status") == "ok" else ' · <b style="color:#b00">engine stopped</b>'
    topo = topology_text(status.get("topology"))
    topo_html = f' · <span data-cb="topology">{e(topo)}</span>' if topo else ""
    return (
        '<div class="cb-header" style="line-height:1.6">'
        f'<b style="font-size:18px">causalboard</b> · model <b data-cb="model">{e(str(status.get("model", "?")))}</b>'
        f' ({e(str(status.get("architecture", "")))}, {e(str(status.get("num_layers", "?")))} layers)'
        f' · device <b data-cb="device">{e(str(status.get("device", "?")))}</b> · {e(str(status.get("dtype", "")))}{topo_html}{state}'
        f'<br><span data-cb="versions" style="color:#555;font-size:12px">{vtext} · API {e(api_url)}</span></div>'
    )


def steering_tab(api_url: str, api_key: str | None) -> Any:
    """The steering view, or a placeholder saying why it is unavailable."""
    try:
        from app.dashboard.steering.view import SteeringView
    except Exception as exc:  # not written yet, or broken: the tracing tab must still work
        return _placeholder(f"The steering view is not available: {type(exc).__name__}: {exc}")
    try:
        return SteeringView(api_url, api_key=api_key)
    except Exception as exc:
        return _placeholder(f"The steering view could not be built: {type(exc).__name__}: {exc}")


def dynamic_panel(api_url: str, api_key: str | None) -> Any:
    """The dynamic-steering panel under the steering view (`app/dashboard/steering/dynamic.py`), or
    None when it cannot be built (the steering tab must still work)."""
    try:
        from app.dashboard.steering.dynamic import DynamicTraceView

        view = DynamicTraceView(api_url, api_key=api_key)
        pn.state.onload(view.refresh_choices)
        return view
    except Exception:
        return None


def _placeholder(text: str) -> pn.pane.HTML:
    return pn.pane.HTML(f'<p style="color:#666" data-cb="steering-placeholder">{html.escape(text)}</p>')


class DashboardPage(pn.viewable.Viewer):
    """The page of one session: `header`, then `tabs` ("Causal tracing" = `tracing`,
    "Steering" = `steering`); with `ask_api_key`, a key prompt stands in for the tabs until a key
    is entered (`tracing`/`steering` are None until then)."""

    def __init__(self, api_url: str, *, api_key: str | None = None, ask_api_key: bool = False, **params: Any):
        super().__init__(**params)
        self.api_url = api_url
        self.header = pn.pane.HTML(header_html(None, api_url), sizing_mode="stretch_width")
        self.body = pn.Column(sizing_mode="stretch_width")
        self.tracing: TracingView | None = None
        self.steering: Any = None
        self.dynamic: Any = None
        self.tabs: pn.Tabs | None = None
        self._layout = pn.Column(self.header, self.body, sizing_mode="stretch_width")
        if ask_api_key and api_key is None:
            self.key_input = pn.widgets.PasswordInput(label="API key (this server guards sweeps and steering)", width=360)
            connect = pn.widgets.Button(label="Connect", color="primary", align="end")
            connect.on_click(lambda _e: self.key_input.value and self.connect(self.key_input.value))
            self.body.objects = [pn.Row(self.key_input, connect)]
        else:
            self.connect(api_key)

    def __panel__(self) -> pn.viewable.Viewable:
        return self._layout

    def connect(self, api_key: str | None) -> None:
        """Build the views (with `api_key` for the API's guarded endpoints) and fill the header."""
        self.tracing = TracingView(self.api_url, api_key=api_key)
        self.steering = steering_tab(self.api_url, api_key)
        self.dynamic = dynamic_panel(self.api_url, api_key)
        steering = pn.Column(self.steering, self.dynamic, sizing_mode="stretch_width") if self.dynamic is not None else self.steering
        self.tabs = pn.Tabs(("Causal tracing", self.tracing), ("Steering", steering), dynamic=False,
                            sizing_mode="stretch_width")
        self.body.objects = [self.tabs]
        pn.state.onload(self._load_status)

    async def _load_status(self) -> None:
        tracing = self.tracing
        try:
            status = await tracing.client.status()
        except Exception as exc:  # shown in the header; the views show their own errors
            self.header.object = header_html(None, self.api_url, f"{type(exc).__name__}: {exc}")
            return
        self.header.object = header_html(status, self.api_url)
        tracing.set_hooks(status.get("hooks") or ())
        if status.get("model") != BUNDLED_MODEL_NAME:  # the form already holds the bundled model's example
            try:
                tasks = await tracing.client.model_tasks()
            except Exception:  # no examples then; the form keeps its defaults
                tasks = None
            if tasks:
                tracing.set_form(default_form(tasks))


def create_page(api_url: str, *, api_key: str | None = None, ask_api_key: bool = False) -> DashboardPage:
    """The whole dashboard for one session (what /dashboard serves)."""
    return DashboardPage(api_url, api_key=api_key, ask_api_key=ask_api_key)


__all__ = ["DashboardPage", "create_page", "header_html", "steering_tab"]

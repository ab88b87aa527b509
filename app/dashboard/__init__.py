"""The causalboard dashboard (Panel/Bokeh), served at /dashboard by the API process and usable
as components inside JupyterLab (`TracingView`, `SteeringView`).

`mount(app)` installs Panel's ASGI application on the API's FastAPI app
(`panel.io.fastapi.add_applications`, Panel ≥ 1.10): Panel claims `/dashboard` (+ its
websocket) and `/static/...`; every other path still goes to the API's routes.

Each browser session builds its page with `create_page(api_url)` (`app/dashboard/app.py`); the page calls the API
over HTTP like any client. `api_url` is `app.state.dashboard_api_url` when set (e.g. behind a
proxy), else the scheme and `Host` of the request that opened the page — the API and the
dashboard share the process, so that address reaches the API.
"""

from __future__ import annotations

import importlib.util
import logging

from fastapi import FastAPI

DASHBOARD_PATH = "/dashboard"
UNUSED_SESSION_LIFETIME_MS = 8_000  # a session with no open websocket is destroyed after this
CHECK_UNUSED_SESSIONS_MS = 2_000
#: uvicorn serves WebSockets (which the Bokeh page needs) only with one of these installed
WEBSOCKET_LIBRARIES = ("websockets", "wsproto")

logger = logging.getLogger("causalboard.dashboard")


def websocket_library() -> str | None:
    """The WebSocket library uvicorn will use, or None (then /dashboard loads but stays blank)."""
    return next((name for name in WEBSOCKET_LIBRARIES if importlib.util.find_spec(name) is not None), None)


def mount(app: FastAPI) -> None:
    """Serve the dashboard at /dashboard on `app` (the API's FastAPI app)."""
    from panel.io.fastapi import add_applications

    if not hasattr(app.state, "dashboard_api_url"):
        app.state.dashboard_api_url = None
    if websocket_library() is None:
        logger.warning("the dashboard at %s needs a WebSocket library for uvicorn (install %s); without one the "
                       "page cannot connect", DASHBOARD_PATH, " or ".join(WEBSOCKET_LIBRARIES))

    def page():
        from app.dashboard.app import create_page

        # the API's settings (`app/api/deps.py`); an app not built by create_app has none
        settings = getattr(app.state, "settings", None)
        return create_page(session_api_url(app), ask_api_key=bool(getattr(settings, "api_key", None)))

    # A closed tab's session (and with it its running sweep and kept clean run, see
    # TracingView._on_session_destroyed) is cleaned up within ~10 s instead of Bokeh's default
    # ~32 s; 8 s still leaves a slow page ample time to open its websocket after loading.
    add_applications({DASHBOARD_PATH: page}, app=app, title="causalboard",
                     unused_session_lifetime_milliseconds=UNUSED_SESSION_LIFETIME_MS,
                     check_unused_sessions_milliseconds=CHECK_UNUSED_SESSIONS_MS)


def session_api_url(app: FastAPI) -> str:
    """The API's base URL as seen from the current Bokeh session (see the module docstring)."""
    import panel as pn

    explicit = getattr(app.state, "dashboard_api_url", None)
    if explicit:
        return str(explicit).rstrip("/")
    request = pn.state.curdoc.session_context.request if pn.state.curdoc and pn.state.curdoc.session_context else None
    host = getattr(request, "host", None) if request is not None else None
    if not host:
        headers = request.headers if request is not None else {}
        host = headers.get("host") or headers.get("Host")
    if not host:
        return "http://127.0.0.1:8000"
    protocol = getattr(request, "protocol", None) or "http"
    return f"{'https' if protocol in ('https', 'wss') else 'http'}://{host}"


__all__ = ["DASHBOARD_PATH", "mount", "session_api_url", "websocket_library"]

"""Serve causalboard's API for a started `Engine` in this process (uvicorn in a daemon thread on a
free local port), for the benchmarks that time requests over HTTP. On a host without the dashboard
stack (the GPU bundle has no Panel) the API is served alone."""
from __future__ import annotations

import socket
import threading
import time


def serve_in_thread(engine) -> tuple[str, object, threading.Thread]:
    """Start serving `engine`; returns (base URL, the uvicorn `Server`: set `should_exit` to stop
    it, its thread) once it accepts connections."""
    import uvicorn

    try:
        import panel  # noqa: F401
    except ImportError:  # no dashboard stack: serve the API only
        import app.dashboard

        app.dashboard.mount = lambda app_: None
    from app.api.app import create_app

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(engine), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    return f"http://127.0.0.1:{port}", server, thread

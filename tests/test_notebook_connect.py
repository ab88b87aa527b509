"""`app.client.notebook.connect()`, the notebooks' one call for a server: it connects to a running
server, or starts `causalboard serve` (a real one, on the bundled model) when nothing answers,
says which it did, stops what it started, and never waits without a bound."""

from __future__ import annotations

import http.server
import os
import re
import threading
import time
from pathlib import Path

import httpx
import pytest

from app.client import notebook
from app.client.notebook import ServerStartError, ServerUnavailable, connect, free_port
from tests.conftest import REPO

pytestmark = pytest.mark.engine  # starts servers (and engines) of its own


def _group_gone(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _answers(url: str) -> bool:
    try:
        httpx.get(f"{url}/health", timeout=2)
        return True
    except httpx.TransportError:
        return False


def test_connect_starts_a_server_when_none_answers_and_close_stops_it(monkeypatch, capsys):
    dead = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("CAUSALBOARD_URL", dead)
    client = connect()
    try:
        server = client.server
        assert client.started_server and server is not None and server.running()
        said = capsys.readouterr().out
        assert f"no server answers at {dead}: starting one at {server.url}" in said
        assert f"started a server at {server.url}: causalboard-tiny (" in said
        assert client.base_url == server.url != dead and server.url.startswith("http://127.0.0.1:")
        status = httpx.get(f"{server.url}/v1/status", timeout=30).json()
        assert status["status"] == "ok" and status["model"] == client.status()["model"] == "causalboard-tiny"
        assert client.generate("The capital of Tarn is", max_tokens=1)["token_ids"]

        # a second call (a re-run cell) reuses the server this process started
        said_again: list[str] = []
        again = connect(say=said_again.append, start_timeout=5)
        assert again.base_url == server.url and again.server is server
        assert said_again == [f"using the server this process started at {server.url} (nothing answers at {dead}): "
                              f"causalboard-tiny ({status['num_layers']} layers, hidden {status['hidden_size']}) on {status['device']}"]
    finally:
        client.close()
    assert server.process.poll() is not None, "the started server is still running after close()"
    assert _group_gone(server.pid), "a process of the started server's group survived close()"
    assert not _answers(server.url) and not server.log_path.exists()
    assert notebook._STARTED == {}
    again.close()  # stopping twice is harmless


def test_connect_uses_the_running_server(server_url, monkeypatch):
    monkeypatch.setenv("CAUSALBOARD_URL", server_url)
    said: list[str] = []
    client = connect(say=said.append)
    with client:
        assert client.server is None and not client.started_server and client.base_url == server_url
        assert len(said) == 1 and said[0].startswith(f"connected to {server_url}: causalboard-tiny (")
        assert client.status()["status"] == "ok"
    assert httpx.get(f"{server_url}/health", timeout=5).status_code == 200  # closing the client left it alone


def test_a_kernel_stops_the_server_it_started_when_it_shuts_down(tmp_path):
    """In a real ipykernel, as in a notebook: the server connect() started goes away with the
    kernel's graceful shutdown (what JupyterLab's "Shut Down Kernel" and "Restart" do)."""
    from jupyter_client import KernelManager

    dead = f"http://127.0.0.1:{free_port()}"
    env = {**os.environ, "CAUSALBOARD_URL": dead, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    km = KernelManager(kernel_name="python3")
    km.start_kernel(env=env, cwd=str(tmp_path))
    said: list[str] = []

    def hook(msg):
        if msg["msg_type"] == "stream":
            said.append(msg["content"]["text"])
        elif msg["msg_type"] == "error":
            said.append(f"ERROR {msg['content']['ename']}: {msg['content']['evalue']}")

    try:
        kc = km.client()
        kc.start_channels()
        kc.wait_for_ready(timeout=120)
        kc.execute_interactive("from app.client.notebook import connect\nclient = connect()\n"
                               "print('SERVER', client.server.pid, client.base_url, client.server.log_path)", timeout=300,
                               output_hook=hook)
        out = "".join(said)
        m = re.search(r"^SERVER (\d+) (\S+) (\S+)$", out, re.M)
        assert m and f"no server answers at {dead}" in out and f"started a server at {m.group(2)}: causalboard-tiny" in out, out
        pid, url, log = int(m.group(1)), m.group(2), Path(m.group(3))
        assert httpx.get(f"{url}/v1/status", timeout=30).json()["status"] == "ok"
        kc.stop_channels()
    finally:
        km.shutdown_kernel(now=False)
    deadline = time.monotonic() + 30
    while not _group_gone(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _group_gone(pid), "the server outlived the kernel that started it"
    assert not _answers(url)
    log.unlink(missing_ok=True)  # removed by the kernel's atexit unless Jupyter killed the kernel first


def _assert_stopped(server) -> None:
    """A server whose start failed: stopped, forgotten, its log kept (the error names it)."""
    assert server.process.poll() is not None and _group_gone(server.pid) and not _answers(server.url)
    assert notebook._STARTED == {}
    assert server.log_path.exists()
    server.log_path.unlink()


def test_a_server_that_cannot_start_is_reported_with_its_log(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ServerStartError) as err:
        connect(f"http://127.0.0.1:{free_port()}", model=str(missing), start_timeout=180, say=lambda _: None)
    message = str(err.value)
    assert "exited with status" in message and str(missing) in message  # the server's own words are quoted
    _assert_stopped(err.value.server)


def test_a_server_that_is_too_slow_is_stopped():
    with pytest.raises(ServerStartError, match=r"did not answer .*/health within 1 s \(stopped it\)") as err:
        connect(f"http://127.0.0.1:{free_port()}", start_timeout=1, say=lambda _: None)
    _assert_stopped(err.value.server)


class _Unhealthy(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's name
        self.send_response(503)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_an_unhealthy_server_is_reported_not_replaced():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Unhealthy)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{srv.server_address[1]}"
        with pytest.raises(ServerUnavailable, match=r"/health answered HTTP 503"):
            connect(url, say=lambda _: None)
    finally:
        srv.shutdown()
        srv.server_close()
    with pytest.raises(ServerUnavailable, match="no causalboard server answers"):
        connect(f"http://127.0.0.1:{free_port()}", start=False, say=lambda _: None)
    assert notebook._STARTED == {}

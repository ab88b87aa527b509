"""One call that gives a notebook a causalboard server: connect to a running one, or start one.

    from app.client.notebook import connect
    client = connect()          # prints "connected to ..." or "started a server at ..."
    URL = client.base_url       # for the dashboard views (TracingView(URL), SteeringView(URL))

Contract of `connect(url=None, ...)`:

* It asks `url` (default `$CAUSALBOARD_URL`, else http://127.0.0.1:8000, where `make run` serves)
  for `GET /health`, waiting at most `connect_timeout` seconds (default 2). A 200 answer means a
  server is there: it returns a client on it and prints `connected to URL: <model> (...) on <device>`.
* When nothing answers (connection refused, timeout) and `start` is true (the default), it starts
  `causalboard serve` as a subprocess of this process on a free port of 127.0.0.1 (the bundled
  model, or `model=`), with this interpreter and this checkout's code, logging to a temporary
  file. It polls `/health` until the server is up, for at most `start_timeout` seconds (default
  240), and prints `started a server at URL: ...`. If the server exits or the time runs out, it
  stops the server and raises `ServerStartError` with the server's last log lines (the log file
  is kept then; a server that stops after a good start removes its log). A second call in
  the same process, when `url` still does not answer, reuses the server started before for the
  same `model`, `tensor_parallel_size` and `pipeline_parallel_size`
  (`using the server this process started at URL: ...`) instead of starting another.
* A started server is stopped by `client.close()`, when this process exits (`atexit`, i.e. when
  the kernel shuts down or restarts), or when the start is interrupted; on Linux the server also
  gets SIGTERM if this process is killed (when `connect` ran in the main thread, as notebook cells
  do). Stopping sends SIGTERM (graceful shutdown), waits at most `STOP_TIMEOUT_S` (at exit
  `EXIT_STOP_TIMEOUT_S`, within Jupyter's 5 s for a kernel to shut down), then kills the server's
  whole process group: nothing it started survives.
* Something that answers `/health` with another status, or that answers `/health` but not
  `/v1/status`, is not treated as absent: `ServerUnavailable` says what answered, and nothing is
  started. With `start=False`, nothing answering raises `ServerUnavailable` too.

No step waits without a bound, so a notebook never hangs on a server that is not there.
"""

from __future__ import annotations

import atexit
import functools
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

import httpx

from app.client import CausalboardClient

DEFAULT_URL = "http://127.0.0.1:8000"
#: seconds `connect` waits for an existing server's `/health`
CONNECT_TIMEOUT_S = 2.0
#: seconds `connect` waits for a server it started to answer `/health` (CPU start-up is ~15-60 s)
START_TIMEOUT_S = 240.0
#: seconds a started server gets for its graceful shutdown before its process group is killed
STOP_TIMEOUT_S = 30.0
#: ... when this process exits: Jupyter kills a kernel that takes more than 5 s to shut down
EXIT_STOP_TIMEOUT_S = 3.0
#: log lines quoted in a `ServerStartError`
LOG_TAIL_LINES = 30
#: the folder that holds this checkout's `app` and `engine_ext` packages
SOURCE_ROOT = Path(__file__).resolve().parents[2]


class ServerUnavailable(RuntimeError):
    """Nothing usable answers at the URL and `connect` was not asked to (or may not) start one."""


class ServerStartError(RuntimeError):
    """A server started by `connect` exited or did not come up in time; the message quotes its log
    and `server` is the (stopped) `LocalServer`."""

    def __init__(self, message: str, server: "LocalServer"):
        super().__init__(message)
        self.server = server


class LocalServer:
    """A `causalboard serve` subprocess on 127.0.0.1 owned by this process (see `connect`)."""

    def __init__(self, port: int | None = None, model: str | None = None, tensor_parallel_size: int = 1,
                 pipeline_parallel_size: int = 1):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = model
        self.parallel = (int(tensor_parallel_size), int(pipeline_parallel_size))
        fd, path = tempfile.mkstemp(prefix=f"causalboard-serve-{self.port}-", suffix=".log")
        os.close(fd)
        self.log_path = Path(path)
        self.process: subprocess.Popen | None = None
        self._stop_at_exit = functools.partial(self.stop, timeout=EXIT_STOP_TIMEOUT_S)

    def start(self) -> "LocalServer":
        args = [sys.executable, "-m", "app.client.notebook", "--serve-child", str(os.getpid()),
                "--parent-death", "1" if threading.current_thread() is threading.main_thread() else "0",
                "serve", "--host", "127.0.0.1", "--port", str(self.port)]
        if self.model:
            args += ["--model", self.model]
        args += ["--tensor-parallel-size", str(self.parallel[0]), "--pipeline-parallel-size", str(self.parallel[1])]
        env = dict(os.environ)
        # the server runs the same code as this client, also when the virtualenv is shared by checkouts
        env["PYTHONPATH"] = os.pathsep.join([str(SOURCE_ROOT), *filter(None, [env.get("PYTHONPATH")])])
        with open(self.log_path, "wb") as log:
            # its own process group, so that stop() can end whatever the server started
            self.process = subprocess.Popen(args, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                            cwd=tempfile.gettempdir(), start_new_session=True)
        atexit.register(self._stop_at_exit)
        return self

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def healthy(self, timeout: float = CONNECT_TIMEOUT_S) -> bool:
        return _health(self.url, timeout) == 200

    def wait_ready(self, timeout: float = START_TIMEOUT_S, poll: float = 0.5) -> None:
        """Return once `/health` answers 200; `ServerStartError` (server stopped) if the process
        exits or `timeout` seconds pass first."""
        deadline = time.monotonic() + timeout
        while True:
            if not self.running():
                code = self.process.returncode if self.process else None
                self.stop(keep_log=True)
                raise ServerStartError(f"the causalboard server exited with status {code} before it answered "
                                       f"{self.url}/health; log {self.log_path}:\n{self.log_tail()}", self)
            if self.healthy(timeout=min(CONNECT_TIMEOUT_S, max(0.1, deadline - time.monotonic()))):
                return
            if time.monotonic() >= deadline:
                self.stop(keep_log=True)
                raise ServerStartError(f"the causalboard server did not answer {self.url}/health within {timeout:.0f} s "
                                       f"(stopped it); log {self.log_path}:\n{self.log_tail()}", self)
            time.sleep(poll)

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError as exc:
            return f"(log unreadable: {exc})"
        return "\n".join(text.splitlines()[-lines:]) or "(empty log)"

    def stop(self, timeout: float = STOP_TIMEOUT_S, keep_log: bool = False) -> None:
        """SIGTERM, wait at most `timeout` s, then SIGKILL the server's process group; the log file
        is removed unless `keep_log` (a failed start keeps it for its error message). Idempotent."""
        atexit.unregister(self._stop_at_exit)
        key = (self.model, *self.parallel)
        if _STARTED.get(key) is self:
            del _STARTED[key]
        proc = self.process
        if proc is None:
            return
        if proc.poll() is None:
            try:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
        try:  # anything left in the group (the server itself after a timeout, engine processes)
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL is not ignorable
            pass
        if not keep_log:
            self.log_path.unlink(missing_ok=True)

    def __repr__(self) -> str:
        state = "running" if self.running() else "stopped"
        return f"LocalServer({self.url}, pid {self.pid}, {state}, log {self.log_path})"


#: servers `connect` started in this process, by (model (None: the bundled one),
#: tensor_parallel_size, pipeline_parallel_size), for reuse by later calls
_STARTED: dict[tuple[str | None, int, int], LocalServer] = {}


class ConnectedClient(CausalboardClient):
    """A `CausalboardClient` that also holds the server `connect` started for it (`server`, None
    when it connected to a running one). `close()` closes the client and stops that server."""

    def __init__(self, base_url: str, server: LocalServer | None = None, **kwargs: Any):
        super().__init__(base_url, **kwargs)
        self.server = server

    @property
    def started_server(self) -> bool:
        return self.server is not None

    def close(self) -> None:
        super().close()
        if self.server is not None:
            self.server.stop()


def connect(url: str | None = None, *, start: bool = True, model: str | None = None, api_key: str | None = None,
            tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1, connect_timeout: float = CONNECT_TIMEOUT_S, start_timeout: float = START_TIMEOUT_S,
            timeout: float = 600.0, say: Callable[[str], Any] = print) -> ConnectedClient:
    """A client on the server at `url` (default `$CAUSALBOARD_URL`, else http://127.0.0.1:8000),
    or on a server started for this process when nothing answers there (see the module docstring).
    `say` receives the one-line report of what was done; `timeout` is the client's (per read).
    `tensor_parallel_size` / `pipeline_parallel_size` apply to a server started here (as
    `causalboard serve -tp/-pp`, docs/distributed.md)."""
    url = (url or os.environ.get("CAUSALBOARD_URL") or DEFAULT_URL).rstrip("/")
    api_key = api_key or os.environ.get("CAUSALBOARD_API_KEY")
    code = _health(url, connect_timeout)
    if code == 200:
        client = ConnectedClient(url, api_key=api_key, timeout=timeout)
        say(f"connected to {url}: {_describe(client, url)}")
        return client
    if code is not None:
        raise ServerUnavailable(f"{url}/health answered HTTP {code}: the server there is not serving (restart it, "
                                f"or set CAUSALBOARD_URL to another server)")
    if not start:
        raise ServerUnavailable(f"no causalboard server answers at {url} (start one with `make run`, or call connect() "
                                f"without start=False to start one here)")
    key = (model, tensor_parallel_size, pipeline_parallel_size)
    server = _STARTED.get(key)
    if server is not None and server.running() and server.healthy():
        client = ConnectedClient(server.url, server, api_key=api_key, timeout=timeout)
        say(f"using the server this process started at {server.url} (nothing answers at {url}): {_describe(client, server.url)}")
        return client
    if server is not None:
        server.stop()
    server = LocalServer(model=model, tensor_parallel_size=tensor_parallel_size, pipeline_parallel_size=pipeline_parallel_size)
    say(f"no server answers at {url}: starting one at {server.url} ({model or 'bundled model'}; log {server.log_path}) ...")
    server.start()
    _STARTED[key] = server
    try:
        server.wait_ready(start_timeout)
    except BaseException:  # an interrupted start (Kernel > Interrupt) does not leave a server behind
        server.stop(keep_log=True)
        raise
    client = ConnectedClient(server.url, server, api_key=api_key, timeout=timeout)
    say(f"started a server at {server.url}: {_describe(client, server.url)}; pid {server.pid}, "
        f"stopped by client.close() or when this kernel exits")
    return client


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _health(url: str, timeout: float) -> int | None:
    """The status code of `GET url/health`, or None when nothing answers within `timeout` s."""
    try:
        return httpx.get(f"{url}/health", timeout=timeout).status_code
    except httpx.TransportError:
        return None


def _describe(client: CausalboardClient, url: str) -> str:
    try:
        s = client.status()
        return f"{s['model']} ({s['num_layers']} layers, hidden {s['hidden_size']}) on {s['device']}"
    except Exception as exc:
        client.close()
        raise ServerUnavailable(f"{url} answers /health but not GET /v1/status ({exc}): is it a causalboard server?") from exc


def _serve_child(argv: list[str]) -> int:
    """`python -m app.client.notebook --serve-child PARENT_PID --parent-death 0|1 serve ...`: on
    Linux, ask for SIGTERM when the parent dies (a kernel killed without running atexit), then
    run the `causalboard` command line with the rest of the arguments."""
    parent, parent_death, rest = int(argv[1]), argv[3] == "1", argv[4:]  # argv: sys.argv[1:]
    if parent_death and sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect
            return 1
    from app.cli.main import main

    return main(rest)


if __name__ == "__main__":
    if len(sys.argv) > 5 and sys.argv[1] == "--serve-child" and sys.argv[3] == "--parent-death":
        sys.exit(_serve_child(sys.argv[1:]))
    sys.exit("usage: python -m app.client.notebook --serve-child PARENT_PID --parent-death 0|1 serve [options]")

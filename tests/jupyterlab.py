"""Real JupyterLab for browser tests: `scripts/lab.sh` (what `make lab` runs) driven by Playwright.

Use it from a test module with

    pytest_plugins = ["tests.browser", "tests.jupyterlab"]

which registers the fixture

* `jupyterlab` (module) — a `JupyterLab`: `scripts/lab.sh` on a free port of 127.0.0.1 with a
  random token, its root a temporary folder holding COPIES of `notebooks/` with their outputs and
  execution counts cleared (the committed notebooks are never touched, and everything a test sees
  was produced by its own run). Its kernels inherit `CAUSALBOARD_URL` = the test server
  (`server_url`) and import this checkout (lab.sh puts it on `PYTHONPATH`). Jupyter's config,
  data, runtime, settings and workspace folders are temporary too (user settings: every notebook
  cell attached to the DOM, no news or update checks, so nothing leaves the loopback). Torn down
  even when a test fails: sessions shut down through the API, then SIGTERM, then SIGKILL of
  JupyterLab's process group; kernels exit on their own once JupyterLab is gone (stragglers are
  killed).

and, for a test, `lab.open(page, name)` -> `LabNotebook`, with `run_all()` (the "Run" menu's
"Run All Cells", then waits until no cell is queued or running and the kernel is idle),
`prompts()`, `cell(source_text)`, `output(i)` (the output area of code cell i), `menu(top, item)`,
`kernel_exec(code)` (runs code in the notebook's kernel as a second client, returns its stdout),
`save()` (File > Save Notebook, then the saved file read back with nbformat), `error_outputs(nb)`
and `shutdown()`, plus `stdout_of(nb)`. `screenshot`, `bokeh_figures` and `bokeh_columns` of
`tests.browser` work inside JupyterLab too (Playwright locators reach into Bokeh's shadow DOM;
`innerText` of a Panel output does not).

`JupyterLab(work, server_url, env={...})` starts one without the fixture, with the launcher's
environment overridden (None removes a variable, so that lab.sh's default applies).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import nbformat
import pytest

from tests.browser import wait_until
from tests.conftest import REPO, free_port

#: seconds JupyterLab gets to answer its REST API after start-up
START_TIMEOUT_S = 90.0
#: user settings written for the test's JupyterLab (plugin id -> settings)
LAB_SETTINGS = {
    # attach every cell to the DOM: outputs of cells out of view are there to be asserted on
    "@jupyterlab/notebook-extension/tracker": {"windowingMode": "none"},
    # no requests to the internet, no news toast over the notebook
    "@jupyterlab/apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False},
}


class JupyterLab:
    """A running JupyterLab (see the module docstring); `url` has no token, `api()` adds it."""

    def __init__(self, work: Path, server_url: str, env: dict[str, str | None] | None = None):
        """`env` overrides the launcher's environment (None removes a variable: lab.sh's default)."""
        self.work = work
        self.env_overrides = env or {}
        self.root = work / "root"
        self.token = secrets.token_hex(16)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server_url = server_url
        self.log_path = work / "jupyterlab.log"
        self.process: subprocess.Popen | None = None
        self._http = httpx.Client(base_url=self.url, headers={"Authorization": f"token {self.token}"}, timeout=30)

    # ---- life cycle
    def start(self) -> "JupyterLab":
        self.root.mkdir(parents=True)
        for src in sorted((REPO / "notebooks").glob("0*.ipynb")):
            nb = nbformat.read(src, as_version=4)
            for cell in nb.cells:
                if cell.cell_type == "code":
                    cell.outputs, cell.execution_count = [], None
            nbformat.write(nb, self.root / src.name)
        dirs = {name: self.work / name for name in ("config", "data", "runtime", "settings", "workspaces", "ipython")}
        for path in dirs.values():
            path.mkdir()
        for plugin, values in LAB_SETTINGS.items():
            target = dirs["settings"] / f"{plugin}.jupyterlab-settings"
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(json.dumps(values))
        env = {**os.environ, "VENV": sys.prefix, "LAB_HOST": "127.0.0.1", "LAB_PORT": str(self.port),
               "LAB_ROOT": str(self.root), "LAB_OPEN": "0", "JUPYTER_TOKEN": self.token,
               "CAUSALBOARD_URL": self.server_url,
               "JUPYTER_CONFIG_DIR": str(dirs["config"]), "JUPYTER_DATA_DIR": str(dirs["data"]),
               "JUPYTER_RUNTIME_DIR": str(dirs["runtime"]), "JUPYTERLAB_SETTINGS_DIR": str(dirs["settings"]),
               "JUPYTERLAB_WORKSPACES_DIR": str(dirs["workspaces"]), "IPYTHONDIR": str(dirs["ipython"])}
        env.pop("DISPLAY", None)
        env.pop("WAYLAND_DISPLAY", None)
        for key, value in self.env_overrides.items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(["bash", str(REPO / "scripts/lab.sh"), "--ServerApp.port_retries=0"], env=env,
                                            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                            cwd=self.work, start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"JupyterLab exited with status {self.process.returncode}:\n{self.log_tail()}")
            try:
                if self._http.get("/api/status", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"JupyterLab did not answer within {START_TIMEOUT_S:.0f} s:\n{self.log_tail()}")
            time.sleep(0.3)

    def stop(self) -> None:
        """Shut every session's kernel down through the API, then stop JupyterLab (SIGTERM, then
        SIGKILL of its process group). Bounded; idempotent."""
        if self.process is None:
            return
        if self.process.poll() is None:
            try:
                for session in self.api("/api/sessions"):
                    self._http.delete(f"/api/sessions/{session['id']}", timeout=30)
            except (httpx.HTTPError, ValueError):
                pass
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait(timeout=10)
        self._http.close()
        # kernels run in sessions of their own and exit once JupyterLab is gone; kill stragglers
        deadline = time.monotonic() + 15
        while self.kernel_pids() and time.monotonic() < deadline:
            time.sleep(0.2)
        for pid in self.kernel_pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    # ---- REST API and pages
    def api(self, path: str) -> Any:
        response = self._http.get(path)
        response.raise_for_status()
        return response.json()

    def kernel_pids(self) -> list[int]:
        """The pids of this JupyterLab's kernel processes (their connection files are in its
        temporary runtime folder)."""
        out = []
        for proc in Path("/proc").iterdir():
            if proc.name.isdigit():
                try:
                    cmd = (proc / "cmdline").read_bytes().split(b"\0")
                except OSError:
                    continue
                if b"ipykernel_launcher" in cmd and any(str(self.work).encode() in part for part in cmd):
                    out.append(int(proc.name))
        return out

    def open(self, page: Any, name: str) -> "LabNotebook":
        """Open `name` (a file in the root) in JupyterLab's UI, collapse the left sidebar, and wait
        for the notebook's kernel to be idle."""
        page.goto(f"{self.url}/lab/tree/{name}?token={self.token}")
        notebook = LabNotebook(self, page, name)
        page.locator(".jp-NotebookPanel .jp-Notebook .jp-Cell").first.wait_for()
        open_tab = page.locator(".jp-SideBar.jp-mod-left .lm-TabBar-tab.lm-mod-current")
        if open_tab.count():  # collapse the file browser: the notebook gets the width
            open_tab.first.click()
        wait_until(lambda: notebook.kernel_state() == "idle", timeout=90, message=f"the kernel of {name} to start")
        return notebook


class LabNotebook:
    """One notebook open in JupyterLab's UI."""

    def __init__(self, lab: JupyterLab, page: Any, name: str):
        self.lab, self.page, self.name = lab, page, name
        self.panel = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden)")

    # ---- kernel
    def session(self) -> dict | None:
        return next((s for s in self.lab.api("/api/sessions") if s["path"].endswith(self.name)), None)

    def kernel_state(self) -> str | None:
        s = self.session()
        return s["kernel"]["execution_state"] if s and s.get("kernel") else None

    def kernel_exec(self, code: str, timeout: float = 60.0) -> str:
        """Run `code` in the notebook's kernel as a second client (jupyter_client, through the
        kernel's connection file; nothing is added to the notebook) and return its stdout. For
        asserting on the kernel's side of what the browser shows."""
        from jupyter_client import BlockingKernelClient

        kernel_id = self.session()["kernel"]["id"]
        client = BlockingKernelClient(connection_file=str(self.lab.work / "runtime" / f"kernel-{kernel_id}.json"))
        client.load_connection_file()
        client.start_channels()
        try:
            # a new subscriber misses what the kernel publishes before its IOPub socket is joined
            # (zmq's slow joiner): the stream output of the code would be lost, the reply still "ok"
            # (`wait_for_ready` answers on the shell channel, which does not prove IOPub joined in
            # time: the kernel publishes `status: busy` first for every request, so a run whose
            # `busy` was missed may have lost its output too and is run again; the code must be
            # safe to repeat)
            client.wait_for_ready(timeout=timeout)
            for _ in range(5):
                out: list[str] = []
                busy: list[bool] = []

                def hook(msg: dict) -> None:
                    if msg["msg_type"] == "status" and msg["content"].get("execution_state") == "busy":
                        busy.append(True)
                    elif msg["msg_type"] == "stream":
                        out.append(msg["content"].get("text", ""))

                reply = client.execute_interactive(code, timeout=timeout, store_history=False, output_hook=hook)
                assert reply["content"]["status"] == "ok", reply["content"]
                if busy:
                    return "".join(out)
                time.sleep(0.5)
            raise AssertionError("the second kernel client never received the kernel's IOPub messages")
        finally:
            client.stop_channels()

    def shutdown(self) -> None:
        s = self.session()
        if s is not None:
            self.lab._http.delete(f"/api/sessions/{s['id']}", timeout=30)

    # ---- cells
    def code_cells(self) -> Any:
        return self.panel.locator(".jp-Cell.jp-CodeCell")

    def prompts(self) -> list[str]:
        """The input prompts of the code cells, in order: '[3]:', '[*]:' (queued/running), '[ ]:'."""
        return [t.strip() for t in self.code_cells().locator(".jp-InputPrompt").all_inner_texts()]

    def output(self, index: int) -> Any:
        """The output area of code cell `index` (0-based among the code cells)."""
        return self.code_cells().nth(index).locator(".jp-OutputArea")

    def cell(self, source_text: str) -> Any:
        """The one code cell whose source contains `source_text`."""
        cell = self.code_cells().filter(has=self.page.locator(".jp-InputArea", has_text=source_text))
        assert cell.count() == 1, f"{self.name}: {cell.count()} code cells contain {source_text!r}"
        return cell

    def run_all(self, timeout: float = 240.0) -> list[str]:
        """Run > Run All Cells through the menu; wait until no cell is queued or running and the
        kernel is idle; return the prompts."""
        self.menu("Run", "Run All Cells")

        def finished() -> list[str] | None:
            prompts = self.prompts()
            running = any("*" in p for p in prompts)
            done = any(re.fullmatch(r"\[\d+\]:", p) for p in prompts)
            return prompts if done and not running and self.kernel_state() == "idle" else None

        return wait_until(finished, timeout=timeout, interval=0.5, message=f"{self.name}: Run All Cells to finish")

    def menu(self, top: str, item: str) -> None:
        """Click `item` in the main menu `top` (labels as shown, e.g. "Run", "Run All Cells")."""
        self.page.locator(".lm-MenuBar-item", has_text=re.compile(rf"^{re.escape(top)}$")).click()
        label = self.page.locator(".lm-Menu-itemLabel", has_text=re.compile(rf"^{re.escape(item)}$"))
        self.page.locator(".lm-Menu .lm-Menu-item", has=label).click()

    # ---- the saved file
    def save(self, timeout: float = 30.0) -> nbformat.NotebookNode:
        """Save through the UI (File > Save Notebook) and return the notebook as written to disk."""
        path = self.lab.root / self.name
        before = path.stat().st_mtime_ns
        self.menu("File", "Save Notebook")
        wait_until(lambda: path.stat().st_mtime_ns != before, timeout=timeout, message=f"{self.name} to be saved")
        return wait_until(lambda: _read(path), timeout=timeout, message=f"{self.name} to be readable")

    def error_outputs(self, nb: nbformat.NotebookNode) -> list[str]:
        return [f"{o.ename}: {o.evalue}" for c in nb.cells if c.cell_type == "code" for o in c.outputs
                if o.output_type == "error"]


def stdout_of(nb: nbformat.NotebookNode) -> str:
    return _stream_of(nb, "stdout")


def stderr_of(nb: nbformat.NotebookNode) -> str:
    """What the kernel wrote to stderr (warnings, logged errors) in the saved notebook."""
    return _stream_of(nb, "stderr")


def _stream_of(nb: nbformat.NotebookNode, name: str) -> str:
    return "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs
                   if o.output_type == "stream" and o.name == name)


def _read(path: Path) -> nbformat.NotebookNode | None:
    try:
        return nbformat.read(path, as_version=4)
    except (ValueError, json.JSONDecodeError, OSError):
        return None


@pytest.fixture(scope="module")
def jupyterlab(server_url, tmp_path_factory):
    lab = JupyterLab(tmp_path_factory.mktemp("jupyterlab"), server_url)
    try:
        lab.start()
        yield lab
    finally:
        lab.stop()

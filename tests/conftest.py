"""Shared fixtures: ONE real vLLM engine (CPU, in-process, eager) per test session, the
transformers reference on the same weights, and a real HTTP server on that engine."""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

REPO = Path(__file__).resolve().parents[1]

#: fixtures that mean a test needs the real vLLM engine / a real browser (see pyproject.toml, tiers)
ENGINE_FIXTURES = frozenset({"engine", "server_url", "http"})
BROWSER_FIXTURES = frozenset({"page", "browser"})


def pytest_collection_modifyitems(config, items):
    """Mark every test with its tier: `browser`, `engine` or `fast` (explicit marks win)."""
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        if item.get_closest_marker("browser") is None and names & BROWSER_FIXTURES:
            item.add_marker(pytest.mark.browser)
        if item.get_closest_marker("engine") is None and (names & ENGINE_FIXTURES or item.get_closest_marker("browser")
                                                           or item.get_closest_marker("multirank")):
            item.add_marker(pytest.mark.engine)
        if item.get_closest_marker("engine") is None and item.get_closest_marker("browser") is None:
            item.add_marker(pytest.mark.fast)


#: lines of captured output that name a root cause (vLLM's worker and engine-core processes log
#: their exception, then the parent raises only "Engine core initialization failed")
ROOT_CAUSE_LINE = re.compile(r"\b\w*(Error|Exception)\b: \S|errno: \d")
ROOT_CAUSE_MAX = 20


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """After the summary (the part of a long log that survives truncation), repeat the lines of the
    failing tests' captured output that name an exception: an engine process's root cause is
    otherwise printed only with the first of the tests that share a failed fixture."""
    seen: dict[str, str] = {}
    for report in terminalreporter.stats.get("failed", []) + terminalreporter.stats.get("error", []):
        for _title, text in getattr(report, "sections", ()):
            for line in text.splitlines():
                line = line.strip()
                if ROOT_CAUSE_LINE.search(line) and line not in seen and len(seen) < ROOT_CAUSE_MAX:
                    seen[line] = report.nodeid
    if seen:
        terminalreporter.section("exceptions named in the failing tests' captured output (first test of each)")
        for line, nodeid in seen.items():
            terminalreporter.line(f"{nodeid}: {line[:400]}")


def model_path() -> Path:
    """The model under test: the bundled one, or CB_TEST_MODEL (a folder with the same tasks.json)."""
    from engine_ext import BUNDLED_MODEL_PATH

    return Path(os.environ.get("CB_TEST_MODEL", BUNDLED_MODEL_PATH))


def script_results(script: str, envs: list[dict], timeout: float = 600) -> list[tuple[dict, str]]:
    """Run `python -c script <bundled model>` once per environment, the processes side by side
    (engine starts are mostly one thread each, and each engine computes with the same thread count,
    so its numbers do not depend on the others); per run, the JSON the script printed on its
    `RESULT ` line and its stderr. A run that fails fails the test with its stderr's tail."""
    import subprocess
    import sys
    import tempfile

    procs = []
    for env in envs:
        out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")  # files: a full pipe would stall a process
        procs.append((subprocess.Popen([sys.executable, "-c", script, str(model_path())], env=env, cwd=REPO,
                                       stdout=out, stderr=err, text=True), out, err))
    results = []
    for proc, out, err in procs:
        code = proc.wait(timeout=timeout)
        out.seek(0)
        err.seek(0)
        stderr = err.read()
        assert code == 0, stderr[-3000:]
        line = next(ln for ln in out.read().splitlines() if ln.startswith("RESULT "))
        results.append((json.loads(line[len("RESULT "):]), stderr))
    return results


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_in_thread(app, what: str = "test server", log_level: str = "warning") -> Iterator[str]:
    """A real uvicorn server for `app` (an ASGI app) on a free loopback port, in a daemon thread:
    yields its base URL, stops it on exit."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level=log_level))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started:
        assert time.time() < deadline, f"{what} did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def wait_healthy(url: str, proc, log_tail: Callable[[], str], timeout: float = 300, every: float = 0.5) -> None:
    """Wait until `url`/health answers 200, failing with the server's log tail if the server
    process `proc` exits first or `timeout` seconds pass."""
    import httpx

    deadline = time.time() + timeout
    while True:
        assert proc.poll() is None, log_tail()
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.time() < deadline, "server did not come up\n" + log_tail()
        time.sleep(every)


def capture_until_evicted(engine, prompt: str, sites: list[str], victim: str, prefix: str, limit: int = 200) -> list[str]:
    """Store captures of `prompt` at `sites` as `{prefix}1`, `{prefix}2`, ... until the source
    store evicts the run `victim` (at most `limit - 1` runs); returns every run id evicted on the
    way. The caller drops the `{prefix}N` runs (`drop_captures_until_evicted`)."""
    evicted: list[str] = []
    for i in range(1, limit):
        g = engine.capture(prompt, sites, "all_prompt", keep_as=f"{prefix}{i}", return_values=False)
        evicted += g.intervention.evicted
        if victim in evicted:
            break
    return evicted


def drop_captures_until_evicted(engine, prefix: str, limit: int = 200) -> None:
    for i in range(1, limit):
        engine.drop_source(f"{prefix}{i}")


@pytest.fixture(scope="session")
def tasks() -> dict:
    return json.loads((model_path() / "tasks.json").read_text())


@pytest.fixture(scope="session")
def engine():
    from engine_ext import Engine

    # a small source store so eviction is testable without thousands of captures
    eng = Engine(model=str(model_path()), device="cpu", source_store_bytes=2 * 1024 * 1024).start()
    yield eng
    eng.close()


@pytest.fixture(scope="session")
def hf_ref():
    from engine_ext.reference.hf import HFReference

    return HFReference(model_path())


@pytest.fixture(scope="session")
def server_url(engine):
    """A real uvicorn server on 127.0.0.1 serving the shared engine."""
    from app.api.app import create_app

    with serve_in_thread(create_app(engine)) as url:
        yield url


@pytest.fixture
def http(server_url):
    import httpx

    from app.client.http import KEEPALIVE_EXPIRY_S

    # idle connections retired before the server's keep-alive timeout closes them (see the constant)
    with httpx.Client(base_url=server_url, timeout=120, limits=httpx.Limits(keepalive_expiry=KEEPALIVE_EXPIRY_S)) as client:
        yield client

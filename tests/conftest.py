"""Shared fixtures: ONE real vLLM engine (CPU, in-process, eager) per test session, the
transformers reference on the same weights, and a real HTTP server on that engine."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
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


def model_path() -> Path:
    """The model under test: the bundled one, or CB_TEST_MODEL (a folder with the same tasks.json)."""
    from engine_ext import BUNDLED_MODEL_PATH

    return Path(os.environ.get("CB_TEST_MODEL", BUNDLED_MODEL_PATH))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    import uvicorn

    from app.api.app import create_app

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(engine), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started:
        if time.time() > deadline:
            raise RuntimeError("test server did not start")
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


@pytest.fixture
def http(server_url):
    import httpx

    with httpx.Client(base_url=server_url, timeout=120) as client:
        yield client

"""`causalboard serve` (what `make run` starts): serves, honours HOST/PORT, binds its port before
the engine starts, stops on SIGTERM."""

from __future__ import annotations

import pytest

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx

from .conftest import REPO, free_port, wait_healthy

pytestmark = pytest.mark.engine  # starts engines of its own


def test_serve_starts_answers_and_stops_on_sigterm(tmp_path):
    port = free_port()
    env = {**os.environ, "HOST": "127.0.0.1", "PORT": str(port)}
    exe = Path(sys.executable).parent / "causalboard"
    log = open(tmp_path / "serve.log", "w+")
    caps = tmp_path / "caps"
    proc = subprocess.Popen([str(exe), "serve", "--capture-dir", str(caps), "--capture-log", '{"hooks": {"post_block": [1, 2]}}'],
                            env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc, lambda: (tmp_path / "serve.log").read_text()[-3000:],
                     timeout=240, every=1)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/generate", json={"prompt": "The capital of", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200 and len(r.json()["token_ids"]) == 2
        # --capture-dir turns on the fork's filesystem capture consumer
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60, json={
            "prompt": "The capital of", "max_tokens": 1,
            "capture": {"filesystem": {"request_id": "cli-req", "hooks": {"post_block": [1]}, "positions": "last_prompt"}}})
        assert r.status_code == 200, r.text
        assert r.json()["capture_results"]["filesystem"]["status"] == "ok"
        written = [p for p in caps.rglob("*") if p.is_file()]
        assert written and all(str(p).startswith(str(caps / "default" / "cli-req")) for p in written), written
        # --capture-log turns on the fork's server-wide logging consumer: one line per capture key
        plain = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60, json={"prompt": "The capital of", "max_tokens": 1})
        assert plain.status_code == 200, plain.text
        cmpl_id = plain.json()["id"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    text = (tmp_path / "serve.log").read_text()
    assert f"http://127.0.0.1:{port}" in text  # the URL is printed
    assert "Application shutdown complete" in text
    assert f"capture key=('{cmpl_id}', 1, 'post_block') rows=1 dtype=float32" in text
    assert f"capture key=('{cmpl_id}', 2, 'post_block') rows=1 dtype=float32" in text
    assert f"capture request={r.json()['id']} own capture, not logged" in text


def test_version_command():
    exe = Path(sys.executable).parent / "causalboard"
    out = subprocess.run([str(exe), "version"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and '"vllm_checked": "0.25.1"' in out.stdout


def test_a_port_in_use_fails_before_the_engine_starts(tmp_path):
    """The port is bound before the engine loads (so nothing can take it meanwhile, `--port 0`
    included): an address in use is reported at once, exit 1, and no engine is started."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "app.cli.main", "serve", "--host", "127.0.0.1", "--port", str(port),
                              "--device", "cpu"], cwd=REPO, capture_output=True, text=True, timeout=120)
    text = out.stdout + out.stderr
    assert out.returncode == 1, text
    assert "address already in use" in text.lower(), text
    assert "Loading" not in text and "engine ready" not in text, text  # failed before the model loaded


def test_the_server_raises_the_young_gc_threshold_and_names_a_bad_value():
    """`causalboard serve` sets its process's youngest-generation GC threshold (fewer collections
    per sweep: docs/performance.md, "Twenty-second session"); CAUSALBOARD_GC_THRESHOLD overrides it,
    and a bad value stops the server before the engine starts, naming the variable."""
    import gc

    from app.cli.main import SERVER_GC_THRESHOLD, apply_server_gc_threshold

    before = gc.get_threshold()
    try:
        assert apply_server_gc_threshold({}) == SERVER_GC_THRESHOLD == gc.get_threshold()[0]
        assert gc.get_threshold()[1:] == before[1:]
        assert apply_server_gc_threshold({"CAUSALBOARD_GC_THRESHOLD": " 700 "}) == 700 == gc.get_threshold()[0]
        for bad in ("0", "-5", "fast", "1e4"):
            with pytest.raises(ValueError, match="CAUSALBOARD_GC_THRESHOLD"):
                apply_server_gc_threshold({"CAUSALBOARD_GC_THRESHOLD": bad})
        assert gc.get_threshold()[0] == 700  # unchanged by the refused values
    finally:
        gc.set_threshold(*before)
    exe = Path(sys.executable).parent / "causalboard"
    r = subprocess.run([str(exe), "serve", "--port", "0"], env={**os.environ, "CAUSALBOARD_GC_THRESHOLD": "0"},
                       capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 2 and "CAUSALBOARD_GC_THRESHOLD must be a whole number" in r.stderr, r.stderr[-2000:]
    assert "starting the engine" not in r.stdout

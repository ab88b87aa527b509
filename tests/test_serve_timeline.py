"""benchmarks/diag/servetimes + serve_timeline.py (fast tier): the recorder wraps a real Starlette
application in a fresh interpreter, the vLLM methods it wraps still exist with the arguments it
passes, and the reader splits events into bursts with the documented figures."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.diag.serve_timeline import bursts, load

REPO = Path(__file__).resolve().parents[1]

APP = """
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

async def done(request):
    return JSONResponse({"ok": True})

app = Starlette(routes=[Route("/v1/completions", done, methods=["POST"]), Route("/health", done)])
with TestClient(app) as client:
    for _ in range(3):
        assert client.post("/v1/completions", json={}).status_code == 200
    assert client.get("/health").status_code == 200
"""


def test_the_recorder_times_each_completion_request_of_a_starlette_app(tmp_path):
    env = {**os.environ, "CB_SERVE_TIMES": str(tmp_path),
           "PYTHONPATH": os.pathsep.join([str(REPO / "benchmarks/diag/servetimes"), str(REPO)])}
    subprocess.run([sys.executable, "-c", APP], env=env, check=True, timeout=120)
    events = load(tmp_path)
    assert [e[0] for e in events] == ["http"] * 3  # /health is not recorded
    assert all(e[2] > 0 for e in events)


def test_the_wrapped_vllm_methods_take_what_the_recorder_passes():
    from vllm.v1.engine.output_processor import OutputProcessor

    assert list(inspect.signature(OutputProcessor.process_outputs).parameters)[:2] == ["self", "engine_core_outputs"]
    assert callable(OutputProcessor.add_request)


def test_bursts_split_overlapping_requests_and_time_their_parts(tmp_path):
    ms = 1_000_000
    events = [["http", 0, 100 * ms, 1], ["http", 5 * ms, 98 * ms, 1],          # burst 1: 0 .. 103 ms
              ["add", 2 * ms, ms, 1], ["add", 7 * ms, ms, 1],
              ["out", 10 * ms, ms, 2], ["out", 20 * ms, ms, 0], ["out", 30 * ms, ms, 2], ["out", 50 * ms, 2 * ms, 2],
              ["http", 200 * ms, 10 * ms, 1], ["add", 201 * ms, ms, 1], ["out", 205 * ms, ms, 1]]  # burst 2
    (tmp_path / "servetimes-1.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    first, second = bursts(load(tmp_path))
    assert first == {"requests": 2, "arrived": 5.0, "added": [2.0, 8.0], "add_us_median": 1000.0, "first_out": 11.0,
                     "steps": 3, "period_ms_median": 20.0, "out_us_median": 1000.0, "last_out": 52.0, "done": 103.0}
    assert second["requests"] == 1 and second["steps"] == 1 and second["period_ms_median"] is None
    assert second["done"] == 10.0

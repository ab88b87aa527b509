"""Engine failure, by real fault injection into a real `causalboard serve` process
(docs/reliability.md): the engine-core process of a multiprocess engine killed, and an exception
raised inside vLLM's engine-core step of an in-process engine. Either way every in-flight request
ends promptly with a clear error (503 `field: engine`; streams: an `error` event, then `[DONE]`),
`/health` turns 503, and `causalboard serve` exits 1 after a short drain.

Each test runs its own server process (the fault kills its engine), through `tests/fault_serve.py`:
the CLI's `main(["serve", ...])` with vLLM's `LLMEngine.step` slowed down (so requests are
reliably in flight when the fault comes) and `EngineCore.step` raising once a trigger file exists.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from .conftest import REPO, free_port, model_path, wait_healthy

pytestmark = pytest.mark.engine  # starts engines of its own

#: every in-flight request must have ended within this many seconds of the fault
PROMPT_END_S = 20
#: `serve` must have exited within this many seconds of the fault (drain + graceful shutdown)
EXIT_S = 60


class Server:
    def __init__(self, tmp_path: Path, *extra: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.trigger = tmp_path / "fault"
        self.log_path = tmp_path / "serve.log"
        self.log = open(self.log_path, "w+")
        cmd = [sys.executable, str(REPO / "tests" / "fault_serve.py"), str(self.trigger), "serve", "--host", "127.0.0.1",
               "--port", str(self.port), "--model", str(model_path()), "--device", "cpu", "--log-level", "warning", *extra]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=REPO, env=dict(os.environ))

    def text(self) -> str:
        return self.log_path.read_text()[-4000:]

    def wait_up(self, timeout: float = 300) -> None:
        wait_healthy(self.url, self.proc, self.text, timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        self.log.close()


@pytest.fixture
def server_factory(tmp_path):
    servers: list[Server] = []

    def make(*extra: str) -> Server:
        servers.append(Server(tmp_path, *extra))
        return servers[-1]

    yield make
    for s in servers:
        s.stop()


class InFlight:
    """A streamed sweep, a streamed generation and a plain generation, all running, each read on
    its own thread until it ends (`results`: what each got, `ended`: when)."""

    def __init__(self, url: str, tasks: dict):
        pair = next(p for p in tasks["pairs"] if p.get("equal_length"))
        self.url = url
        self.results: dict[str, object] = {}
        self.ended: dict[str, float] = {}
        self.started = {k: threading.Event() for k in ("sweep", "stream", "plain")}
        sweep = {"prompt": pair["corrupt_prompt"], "clean_prompt": pair["clean_prompt"], "answer_token": " " + pair["answer"],
                 "metric": "logprob", "hooks": ["pre_attn", "post_attn", "post_block"], "max_concurrency": 1, "stream": True}
        long = {"prompt": "The capital of Tarn is", "max_tokens": 100, "ignore_eos": True}
        self.threads = [
            threading.Thread(target=self._stream, args=("sweep", "/v1/patch_sweep", sweep, "cell"), daemon=True),
            threading.Thread(target=self._stream, args=("stream", "/v1/generate", {**long, "stream": True}, "token"), daemon=True),
            threading.Thread(target=self._plain, args=("plain", "/v1/generate", long), daemon=True),
        ]
        # the sweep (hundreds of cells, one at a time) first: it is surely in flight at the fault;
        # the generations start once it runs (on the fast CPU mode a 100-token generation can end
        # within the 0.3 s before the fault: then it must have ended normally, see below)
        self.threads[0].start()
        assert self.started["sweep"].wait(120), "the sweep never started"
        for t in self.threads[1:]:
            t.start()

    def _stream(self, name: str, path: str, body: dict, running_type: str) -> None:
        events = []
        try:
            with httpx.stream("POST", self.url + path, json=body, timeout=120) as r:
                assert r.status_code == 200, r.read()
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    events.append(data if data == "[DONE]" else json.loads(data))
                    if isinstance(events[-1], dict) and events[-1].get("type") == running_type:
                        self.started[name].set()
        except Exception as exc:  # noqa: BLE001 - recorded for the assertion
            events.append(exc)
        self.results[name] = events
        self.ended[name] = time.monotonic()
        self.started[name].set()

    def _plain(self, name: str, path: str, body: dict) -> None:
        self.started[name].set()  # in flight as soon as it is sent (no events to wait for)
        try:
            r = httpx.post(self.url + path, json=body, timeout=120)
            self.results[name] = (r.status_code, r.json())
        except Exception as exc:  # noqa: BLE001
            self.results[name] = exc
        self.ended[name] = time.monotonic()

    def wait_running(self, timeout: float = 120) -> None:
        for name, ev in self.started.items():
            assert ev.wait(timeout), f"{name} never started"
        time.sleep(0.3)  # the plain request reaches the engine
        assert "sweep" not in self.ended, f"the sweep finished before the fault: {self.results.get('sweep')}"

    def join(self, timeout: float) -> None:
        for t in self.threads:
            t.join(timeout)
            assert not t.is_alive(), "a request hung after the engine died"


def check_ended_with_engine_error(flight: InFlight, fault_at: float) -> None:
    """Every request in flight at the fault ended promptly with the engine error; a generation
    that had already ended before the fault must have ended normally.

    `fault_at` is read just *before* the fault is injected: read after it, the test's thread can
    lose the CPU between the two (2 busy cores, three reader threads) for long enough that a request
    ends with the engine error before `fault_at` is taken, and would be mistaken for one that ended
    before the fault (seen in CI: a 503 classed as early)."""
    for name in ("sweep", "stream", "plain"):
        assert flight.ended[name] - fault_at < PROMPT_END_S, name
    early = {name for name in ("stream", "plain") if flight.ended[name] < fault_at}
    if "plain" in early:
        assert flight.results["plain"][0] == 200, flight.results["plain"]
    else:
        status, body = flight.results["plain"]
        assert status == 503 and body["field"] == "engine" and body["error"].startswith("engine: "), body
    if "stream" in early:
        events = flight.results["stream"]
        assert events[-1] == "[DONE]" and events[-2].get("type") == "done", events[-3:]
    for name in ("sweep", "stream"):
        if name in early:
            continue
        events = flight.results[name]
        assert not any(isinstance(e, Exception) for e in events), events
        assert events[-1] == "[DONE]", events[-3:]
        errors = [e for e in events if isinstance(e, dict) and e.get("type") == "error"]
        assert len(errors) == 1 and errors[0]["error"].startswith("engine: "), events[-3:]
        kinds = [e.get("type") for e in events[:-1]]
        assert "done" not in kinds  # never a result after the failure
        if name == "stream":
            assert kinds[-1] == "error"  # the error is the last event before [DONE]
        else:  # a sweep's log ends with its summary (what was done), marked cancelled
            assert kinds[-2:] == ["error", "summary"] and events[-2]["cancelled"] is True


def check_dead_then_exit(server: Server, fault_at: float) -> None:
    r = httpx.get(f"{server.url}/health", timeout=5)
    assert r.status_code == 503 and r.json()["field"] == "engine", r.text
    r = httpx.post(f"{server.url}/v1/generate", json={"prompt": "The capital of", "max_tokens": 1}, timeout=10)
    assert r.status_code == 503 and r.json()["field"] == "engine", r.text
    code = server.proc.wait(timeout=EXIT_S)
    assert code == 1, server.text()
    assert time.monotonic() - fault_at < EXIT_S
    assert "exiting with status 1 so a supervisor restarts the server" in server.text()


def test_killed_engine_core_process_ends_everything_in_flight_and_serve_exits_1(server_factory, tasks):
    server = server_factory("--multiprocess")
    server.wait_up()
    flight = InFlight(server.url, tasks)
    flight.wait_running()
    cores = [p for p in psutil.Process(server.proc.pid).children(recursive=True) if "EngineCore" in " ".join(p.cmdline()) + p.name()]
    assert len(cores) == 1, [(p.pid, p.name(), p.cmdline()) for p in psutil.Process(server.proc.pid).children(recursive=True)]
    fault_at = time.monotonic()  # taken before the fault: see check_ended_with_engine_error
    cores[0].kill()  # SIGKILL, as the OOM killer would
    flight.join(PROMPT_END_S + 5)
    check_ended_with_engine_error(flight, fault_at)
    check_dead_then_exit(server, fault_at)
    # noticed by the loop's watchdog (the process is gone) or by vLLM's client raising first
    log = server.log_path.read_text()
    assert "engine-core process died" in log or "engine loop failed" in log, log[-3000:]


def test_exception_inside_an_in_process_step_ends_everything_in_flight_and_serve_exits_1(server_factory, tasks):
    server = server_factory("--no-multiprocess")
    server.wait_up()
    flight = InFlight(server.url, tasks)
    flight.wait_running()
    fault_at = time.monotonic()  # taken before the fault: see check_ended_with_engine_error
    server.trigger.write_text("fault")
    flight.join(PROMPT_END_S + 5)
    check_ended_with_engine_error(flight, fault_at)
    check_dead_then_exit(server, fault_at)
    assert "injected fault inside EngineCore.step" in server.text()

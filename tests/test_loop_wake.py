"""Fast tier (no engine): a command queued while the engine loop's thread waits in
`LLMEngine.step` for the engine core's outputs wakes it (`seam.wake_output_wait`), so requests
submitted meanwhile reach the core before the step it waits for ends — what lets a sweep's next
group reach a GPU's engine core while the core works on the last one. The wake is one empty
output: nothing is lost, duplicated or reordered, and without it (`CAUSALBOARD_WAKE_LOOP=0`)
the command waits for the step, as vLLM's own loop does. A fake engine stands for vLLM's: its
`step` blocks on a queue as `SyncMPClient.get_output` does."""

from __future__ import annotations

import queue
import threading
import time
from types import SimpleNamespace

import pytest

from engine_ext.engine.loop import EngineLoop
from engine_ext.worker import seam

WAKE = object()


class FakeEngine:
    """`LLMEngine`'s surface the loop uses; `step` waits for `release` (or a wake)."""

    def __init__(self) -> None:
        self.outputs: queue.Queue = queue.Queue()
        self.added: list[str] = []
        self.unfinished: set[str] = set()
        self.steps = 0

    def has_unfinished_requests(self) -> bool:
        return bool(self.unfinished)

    def add_request(self, request_id, prompt, params) -> None:
        self.added.append(request_id)
        self.unfinished.add(request_id)

    def abort_request(self, ids) -> None:
        self.unfinished.difference_update(ids)

    def step(self) -> list:
        self.steps += 1
        got = self.outputs.get()
        if got is WAKE:
            return []
        for out in got:
            self.unfinished.discard(out.request_id)
        return got

    def release(self, *request_ids: str) -> None:
        """The core's outputs: each request finished."""
        self.outputs.put([SimpleNamespace(request_id=r, finished=True) for r in request_ids])


class ListSink:
    def __init__(self) -> None:
        self.outputs: list = []
        self.done = threading.Event()

    def on_output(self, output, worker_result=None) -> None:
        self.outputs.append(output)
        if output.finished:
            self.done.set()

    def on_error(self, error) -> None:
        self.outputs.append(error)
        self.done.set()


def _wait_for(cond, timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.005)
    return cond()


@pytest.fixture
def loop(monkeypatch):
    wakes: list[int] = []

    def wake(engine) -> None:
        wakes.append(1)
        engine.outputs.put(WAKE)

    monkeypatch.setattr(seam, "wake_output_wait", wake)
    monkeypatch.setattr(seam, "output_wait_wakeable", lambda engine: True)  # the fake stands for a SyncMPClient
    fake = FakeEngine()
    lp = EngineLoop(lambda: fake, name="test-wake")
    lp.fake, lp.wakes = fake, wakes
    yield lp
    lp.shutdown()


def test_requests_submitted_while_the_loop_waits_for_a_step_reach_the_engine_at_once(loop):
    loop.start()
    a, b, c = ListSink(), ListSink(), ListSink()
    loop.submit("a", [1], None, a)
    assert _wait_for(lambda: loop.fake.steps >= 1 and loop._waiting), "the loop waits in step for a's outputs"
    loop.submit_many([("b", [2], None, b, None), ("c", [3], None, c, None)])
    # added while a's step is still outstanding (nothing released yet)
    assert _wait_for(lambda: loop.fake.added == ["a", "b", "c"]), loop.fake.added
    assert loop.wakes == [1] and not a.done.is_set()
    loop.fake.release("a")
    loop.fake.release("b", "c")
    for s in (a, b, c):
        assert s.done.wait(5)
        assert [o.request_id for o in s.outputs] == [s.outputs[0].request_id] and len(s.outputs) == 1
    assert loop.in_flight == 0


def test_a_call_while_the_loop_waits_runs_before_the_step_ends(loop):
    loop.start()
    a = ListSink()
    loop.submit("a", [1], None, a)
    assert _wait_for(lambda: loop._waiting)
    fut = loop.call(lambda engine: list(engine.added))
    assert fut.result(timeout=5) == ["a"] and not a.done.is_set()
    loop.fake.release("a")
    assert a.done.wait(5) and len(a.outputs) == 1


def test_without_the_wake_a_command_waits_for_the_step(loop, monkeypatch):
    monkeypatch.setenv("CAUSALBOARD_WAKE_LOOP", "0")
    loop.start()
    a, b = ListSink(), ListSink()
    loop.submit("a", [1], None, a)
    assert _wait_for(lambda: loop.fake.steps >= 1)
    loop.submit("b", [2], None, b)
    time.sleep(0.2)
    assert loop.fake.added == ["a"] and loop.wakes == []
    loop.fake.release("a")
    assert _wait_for(lambda: loop.fake.added == ["a", "b"])
    loop.fake.release("b")
    assert a.done.wait(5) and b.done.wait(5)


def test_the_engine_setting_is_read_from_the_environment(monkeypatch):
    """`EngineLoop._can_wake` itself: off by `CAUSALBOARD_WAKE_LOOP=0`, else what the seam says
    of the engine (a fake one is no `SyncMPClient`: not wakeable)."""
    lp = EngineLoop(lambda: None)
    lp.engine = FakeEngine()
    assert EngineLoop._can_wake(lp) is False
    monkeypatch.setattr(seam, "output_wait_wakeable", lambda engine: True)
    assert EngineLoop._can_wake(lp) is True
    monkeypatch.setenv("CAUSALBOARD_WAKE_LOOP", "0")
    assert EngineLoop._can_wake(lp) is False


def test_engine_switches_read_one_way(monkeypatch):
    """`switches.env_switch`, what every engine switch of the environment goes through."""
    from engine_ext.switches import env_switch

    for value, default, want in [("1", False, True), (" ON ", False, True), ("true", False, True),
                                 ("0", True, False), ("Off", True, False), ("FALSE", True, False),
                                 ("", True, True), ("", False, False), ("maybe", True, True), ("maybe", False, False)]:
        monkeypatch.setenv("CB_TEST_SWITCH", value)
        assert env_switch("CB_TEST_SWITCH", default) is want, (value, default)
    monkeypatch.delenv("CB_TEST_SWITCH")
    assert env_switch("CB_TEST_SWITCH", True) is True and env_switch("CB_TEST_SWITCH", False) is False

"""Fast tier (no engine, no GPU): when `step_graphs.RepeatingLaunch` captures and replays. The
capture itself is replaced by a recorder here (a CUDA graph needs a GPU: `dynamic_gpu_check.py`
runs the real one); what is checked is the bookkeeping that decides which launch runs."""

from __future__ import annotations

from engine_ext.dynamic import step_graphs


class _Graph:
    def __init__(self, key):
        self.key, self.replays = key, 0

    def replay(self):
        self.replays += 1


def test_a_launch_is_captured_after_repeating_and_replayed_only_for_its_key(monkeypatch):
    captured = []
    monkeypatch.setattr(step_graphs, "capture_launch", lambda launch: captured.append(_Graph(current[0])) or captured[-1])
    eager = []
    current = [None]
    rl = step_graphs.RepeatingLaunch()

    def run(key, graphs=True):
        current[0] = key
        return rl.run(lambda: eager.append(key), key=key, graphs=graphs)

    # AFTER eager runs in a row with one key, then the capture; replays from the next run
    assert [run("p1") for _ in range(step_graphs.AFTER)] == [False] * step_graphs.AFTER
    assert [g.key for g in captured] == ["p1"] and len(eager) == step_graphs.AFTER
    assert run("p1") is True and captured[0].replays == 1
    # another key (the scores moved to another address) runs eagerly: p1's graph holds p1's
    # address and is never replayed for it; once p2 has repeated, it is captured in p1's place
    assert [run("p2") for _ in range(step_graphs.AFTER)] == [False] * step_graphs.AFTER
    assert captured[0].replays == 1 and [g.key for g in captured] == ["p1", "p2"]
    assert run("p2") is True and captured[1].replays == 1
    assert run("p1") is False and captured[0].replays == 1 and eager[-1] == "p1"
    # graphs switched off: eager, even for the captured key
    assert run("p2", graphs=False) is False and eager[-1] == "p2"


def test_a_failed_capture_is_not_retried(monkeypatch):
    tries = []
    monkeypatch.setattr(step_graphs, "capture_launch", lambda launch: tries.append(1))
    rl = step_graphs.RepeatingLaunch()
    for key in ("a", "b"):
        for _ in range(2 * step_graphs.AFTER):
            assert rl.run(lambda: None, key=key) is False
    assert len(tries) == 1 and rl.graph is None


def test_a_key_that_changes_every_run_is_never_captured(monkeypatch):
    monkeypatch.setattr(step_graphs, "capture_launch", lambda launch: (_ for _ in ()).throw(AssertionError("captured")))
    rl = step_graphs.RepeatingLaunch()
    for i in range(3 * step_graphs.AFTER):
        assert rl.run(lambda: None, key=i) is False
    # graphs not allowed: never captured either
    rl = step_graphs.RepeatingLaunch()
    for _ in range(3 * step_graphs.AFTER):
        assert rl.run(lambda: None, key="same", graphs=False) is False

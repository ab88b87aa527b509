"""The sampling profiler of `benchmarks/diag/` (issue #13's GPU sweep diagnosis): it must see a
busy thread where it is busy, and a forked child armed by `arm_children` must write its report
when the flag file goes away. Fast tier: no engine."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest

from benchmarks.diag.stack_sampler import StackSampler

from .conftest import REPO


def _spin(seconds: float) -> None:
    t = time.time()
    while time.time() - t < seconds:
        sum(range(500))


def test_the_sampler_finds_a_busy_thread_in_its_function():
    worker = threading.Thread(target=_spin, args=(0.4,), name="busy-worker")
    sampler = StackSampler(interval_s=0.002).start()
    worker.start()
    worker.join()
    report = sampler.stop()
    busy = report["threads"]["busy-worker"]
    assert busy["samples"] >= 10
    assert busy["idle_leaf_frac"] < 0.5
    leaf, share = busy["self"][0]
    assert leaf.endswith(":_spin") and share > 0.5, busy["self"][:3]
    # the thread that waited for it is idle at a known waiting leaf
    assert report["threads"]["MainThread"]["idle_leaf_frac"] > 0.5


#: run in a process of its own: arming registers an at-fork hook for the rest of that process
FORK_SCRIPT = """
import os, sys, time
from benchmarks.diag.stack_sampler import arm_children
out, flag = sys.argv[1], sys.argv[2]
def _spin(seconds):
    t = time.time()
    while time.time() - t < seconds:
        sum(range(500))
arm_children(out, flag, core_timeline=False)
open(flag, "w").close()
pid = os.fork()
if pid == 0:  # the child: busy, then end the window and give the watcher time to write
    try:
        _spin(0.3)
        os.remove(flag)
        time.sleep(0.5)
    finally:
        os._exit(0)
os.waitpid(pid, 0)
print(pid)
"""


@pytest.mark.skipif(not hasattr(os, "register_at_fork"), reason="needs os.register_at_fork")
def test_a_forked_child_reports_when_the_flag_goes_away(tmp_path):
    out, flag = tmp_path / "stacks", tmp_path / "sampling"
    done = subprocess.run([sys.executable, "-c", FORK_SCRIPT, str(out), str(flag)], cwd=REPO, capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr[-2000:]
    pid = int(done.stdout.split()[-1])
    report = json.loads((out / f"stack-{pid}.json").read_text())
    assert report["pid"] == pid and report["samples"] > 0
    assert any(f.endswith(":_spin") for t in report["threads"].values() for f, _ in t["self"])

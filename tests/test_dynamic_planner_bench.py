"""Fast tier (no engine): the dynamic planner micro-benchmark (`benchmarks/dynamic_planner_bench.py`)
runs and its workload is what it says: a policy engaged throughout applies one action per request
and decode step, a monitor that never fires applies none (its timings mean nothing here)."""

from __future__ import annotations

import sys

import numpy as np

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import dynamic_planner_bench as bench  # noqa: E402


def test_the_dynamic_planner_benchmark_runs_its_workload():
    v = np.ones(bench.H, np.float32) * 0.01
    steps = 8
    got = {name: bench.run(dyn, steps) for name, dyn in bench.variants(v).items()}
    assert got["vanilla"]["actions"] == 0 and "plan_rows" not in got["vanilla"]
    assert got["monitor_only"]["actions"] == 0
    # the first generated position is decided from the prefill's score: every decode step acts
    assert got["threshold_on"]["actions"] == bench.BATCH * steps
    assert got["proportional"]["actions"] == bench.BATCH * steps
    assert all(r["plan_step"] > 0 for r in got.values())
    assert all(got[name]["plan_rows"] > 0 and got[name]["after_wait"] > 0 for name in ("monitor_only", "threshold_on"))

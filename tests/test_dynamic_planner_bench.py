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


def test_decisions_on_the_device_apply_the_same_actions():
    """`run(..., decisions=True)`: the chain's decisions taken on the device (CPU tensors here) and
    read back as arrays; as many actions as on the host path."""
    v = np.ones(bench.H, np.float32) * 0.01
    dyn = bench.variants(v)["proportional"]
    dev = bench.run(dyn, 8, decisions=True)
    host = bench.run(dyn, 8, decisions=False)
    assert dev["actions"] == host["actions"] == bench.BATCH * 8
    assert dev["device_held_reads"] > 0 and host["device_held_reads"] == 0


def test_the_planner_profile_prints_each_variant(capsys, monkeypatch):
    """`benchmarks/diag/dynamic_planner_profile.py` runs (CPU, few steps) and prints a profile per variant."""
    sys.path.insert(0, str(REPO / "benchmarks" / "diag"))
    import dynamic_planner_profile as prof

    monkeypatch.setattr(sys, "argv", ["x", "--steps", "6", "--top", "5", "--variants", "threshold_on,proportional@device"])
    prof.main()
    out = capsys.readouterr().out
    assert "===== threshold_on (cpu, 6 steps)" in out and "===== proportional@device (cpu, 6 steps)" in out
    assert out.count("function calls") == 2

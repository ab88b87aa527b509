"""`benchmarks/diag/dynamic_gaps.py`'s interval arithmetic (fast tier: no engine; the script itself
runs in tests/test_benchmark_smoke.py)."""

from __future__ import annotations

from benchmarks.diag.dynamic_gaps import idle_report, merge


def test_dynamic_gaps_idle_report_merges_overlapping_kernels():
    assert merge([(5, 7), (0, 2), (1, 3), (6, 6.5)]) == [(0, 3), (5, 7)]
    # kernels overlapping (0-40, 30-45), a 5 µs gap inside the first "forward", a 60 µs wait before the second
    r = idle_report([(0, 40), (50, 100), (30, 45), (160, 260)], steps=2)
    assert r["kernels"] == 4 and r["window_ms"] == 0.26
    assert r["busy_frac"] == round(195 / 260, 4)
    assert r["idle_us_per_step"] == 32.5 and r["big_gaps"] == 1 and r["big_gap_us_per_step"] == 30.0
    assert idle_report([], steps=3) == {"kernels": 0}

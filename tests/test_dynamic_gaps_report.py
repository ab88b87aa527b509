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


def test_attribute_gaps_names_the_launch_and_the_host_call_before_it():
    from benchmarks.diag.dynamic_gaps import _is_host_call, attribute_gaps

    kernels = [(0, 100, "graph_kernel", 1), (90, 110, "copy", 3), (300, 400, "triton_next", 2), (410, 420, "small", 4)]
    calls = [(-10, -5, "cudaGraphLaunch", 1, 7), (20, 30, "cudaMemcpyAsync", 3, 7),
             (60, 115, "cudaEventSynchronize", 9, 7), (280, 290, "cuLaunchKernel", 2, 7), (291, 292, "cuLaunchKernel", 4, 8)]
    r = attribute_gaps(kernels, calls)
    # one gap of 190 µs (110 -> 300); the 10 µs one (400 -> 410) is below the threshold
    assert r["gaps"] == 1 and r["attributed"] == 1
    assert r["launch"] == [["cuLaunchKernel", 1, 190.0]]
    assert r["before"] == [["cudaEventSynchronize", 1, 190.0]]
    assert r["next"] == [["triton_next", 1, 190.0]]
    assert r["late_us_median"] == 180.0 and r["host_us_median"] == 165.0
    assert attribute_gaps([], calls) == {"gaps": 0}
    assert _is_host_call("cudaGraphLaunch") and _is_host_call("cuLaunchKernel") and not _is_host_call("aten::mm")

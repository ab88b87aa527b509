"""The side-by-side benchmark harness (`benchmarks/compare/`) runs on CPU at tiny sizes and
reports, so it cannot rot between GPU measurements. Asserts only that every part runs and emits
its result lines (the numbers of a CPU smoke run mean nothing; docs/performance.md has the GPU
figures)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO, model_path

pytestmark = pytest.mark.engine  # starts engines of its own

BENCH = REPO / "benchmarks" / "compare"


def _run(script: str, *args: str, timeout: int = 600) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.run([sys.executable, str(BENCH / script), *args], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"bench"')]
    assert not [ln for ln in lines if "error" in ln], lines
    return lines


def test_causalboard_part_runs_and_reports():
    lines = _run("cb_bench.py", "--model", str(model_path()), "--device", "cpu", "--tasks", "p2,p1,p3,p1http",
                 "--reps", "1", "--tag", "CB_smoke")
    tags = {ln["bench"] for ln in lines}
    assert {"CB_smoke_start", "CB_smoke_p2", "CB_smoke_p1", "CB_smoke_p3", "CB_smoke_p1http"} <= tags, tags
    p1 = {ln["variant"]: ln for ln in lines if ln["bench"] == "CB_smoke_p1"}
    assert set(p1["engine_patched_768"]["status_counts"]) == {"ok"}  # every cell patched, none voided
    assert all(ln["cells_per_s"] > 0 for ln in p1.values())


def test_stock_vllm_part_runs_and_reports():
    lines = _run("vllm_bench.py", "--model", str(model_path()), "--tag", "S_smoke", "--tasks", "p1,p2", "--attn", "CPU_ATTN",
                 "--dtype", "float32", "--p1-n", "32", "--p1-reps", "1", "--p2-reps", "1", "--batches", "2",
                 "--max-tokens", "4", "--eager")  # eager: the harness, not inductor (~30 s to compile)
    tasks = {ln.get("task") for ln in lines}
    assert {"p1", "p2"} <= tasks, lines
    assert [ln for ln in lines if ln.get("task") == "p1"][0]["n_with_both_ids"] == 32


def test_hf_hooks_part_runs_and_reports():
    lines = _run("hf_patch.py", "--model", str(model_path()), "--device", "cpu", "--reps", "1", "--chunks", "16")
    assert any("cells_per_s" in json.dumps(ln) for ln in lines), lines


def test_dynamic_steering_cost_bench_runs_and_reports():
    """Issue 15's cost benchmark (`benchmarks/dynamic_bench.py`): every variant, with decisions
    on the device and on the host, reports its ratios; the checksum stays consistent."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "dynamic_bench.py"), "--device", "cpu",
                           "--tokens", "6", "--batch", "4", "--reps", "2", "--ab-device"],
                          capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"bench"')]
    decode = {ln["variant"]: ln for ln in lines if ln["bench"] == "dyn_decode"}
    assert {"vanilla", "threshold_on", "proportional", "threshold_on@device", "proportional@host"} <= set(decode)
    assert all(ln["tok_s"] > 0 and ln["ratio_paired"] > 0 and len(ln["reps_s"]) == 2 for ln in decode.values())
    status = [ln for ln in lines if ln["bench"] == "dyn_status"][0]
    assert status["determinism"]["consistent"] is True


def test_p3_profile_and_worker_capture_benches_run_and_report(tmp_path):
    """`benchmarks/diag/p3_stacks.py` (P3 with the stack sampler, one window per variant),
    `benchmarks/diag/capture_worker.py` (the worker's host time per captured request) and
    `benchmarks/diag/ring_populate.py` (the ring's values copied out, page tables filled or not)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    diag = REPO / "benchmarks" / "diag"
    proc = subprocess.run([sys.executable, str(diag / "p3_stacks.py"), "--model", str(model_path()), "--device", "cpu",
                           "--n", "12", "--reps", "1", "--dir", str(tmp_path / "stacks")],
                          capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = [json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith('{"bench"')]
    assert {(ln["bench"], ln.get("variant")) for ln in lines} >= {("p3", "vanilla"), ("p3", "capture"),
                                                                   ("p3_sampled", "vanilla"), ("p3_sampled", "capture")}
    assert {"client-vanilla.json", "client-capture.json"} <= set(os.listdir(tmp_path / "stacks"))
    proc = subprocess.run([sys.executable, str(diag / "capture_worker.py"), "--n", "24", "--per-step", "8", "--reps", "1"],
                          capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    (line,) = [json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith('{"bench"')]
    assert line["bench"] == "capture_worker" and line["us_per_request"]["total_us_per_request"] > 0
    assert line["ring"]["full"] == 0 and line["ring"]["in_use"] == 0, line["ring"]
    proc = subprocess.run([sys.executable, str(diag / "ring_populate.py"), "--ring-mib", "4", "--results", "8", "--rounds", "1"],
                          capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = [json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith('{"bench"')]
    assert [ln["populate"] for ln in lines] == [False, True] and all(ln["copy_ms"] >= 0 for ln in lines)


def test_the_worker_cell_bench_runs_and_reports():
    """`benchmarks/diag/cell_worker.py` (the worker's host time per sweep cell, no engine): every
    cell registered, planned, finished and collected, no slot left in use."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "diag" / "cell_worker.py"), "--n", "40", "--per-step", "16",
                           "--reps", "1", "--profile", "5"], capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    (line,) = [json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith('{"bench"')]
    assert line["bench"] == "cell_worker" and line["n"] == 40 and line["slots_in_use"] == 0, line
    assert all(line["us_per_cell"][k] > 0 for k in ("register", "plan_step", "finish")), line
    assert "function calls" in proc.stdout  # the profile of --profile


def test_the_segmented_cells_bench_runs_and_reports_equal_scores():
    """`benchmarks/diag/segment_cells.py` (cells as segments against one request per cell) on the
    bundled model: it runs, reports both speeds and finds every cell's scores equal."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "diag" / "segment_cells.py"), "--reps", "1",
                           "--block-size", "16"], capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    (line,) = [json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith('{"bench"')]
    assert line["equal_scores"] is True and line["cells_per_request"] >= 2 and line["speedup"] > 0, line


def test_p1_profile_bench_runs_and_reports(tmp_path):
    """`benchmarks/diag/p1_stacks.py` (P1 with the stack sampler and both timelines, one window
    per variant), causalboard's side, with the engine core in its own process (`--multiprocess`,
    as on a GPU); with `--http --seg-ab` also the sweep over HTTP as the service runs it
    (`sweep_http`) and with every cell its own request (`sweep_http_noseg`), each reporting how its
    cells ran. The core's stack report holds its step timeline, and the tokens its steps scheduled
    for `patched` add up to the cells' prompts (every patched cell computes its whole 16-token
    prompt: nothing counted twice, nothing missing)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "VLLM_CPU_KVCACHE_SPACE": "1"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "diag" / "p1_stacks.py"), "--engine", "cb",
                           "--multiprocess", "--http", "--seg-ab", "--model", str(model_path()), "--device", "cpu",
                           "--reps", "1", "--dir", str(tmp_path / "p1")],
                          capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = [json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith('{"bench"')]
    variants = ("nospec", "scored", "patched", "sweep_http", "sweep_http_noseg")
    assert {(ln["bench"], ln["variant"]) for ln in lines if ln["bench"] != "p1_sweep_mode"} == {
        (b, v) for b in ("p1", "p1_sampled") for v in variants}
    modes = {ln["variant"]: ln for ln in lines if ln["bench"] == "p1_sweep_mode"}
    assert set(modes) == {"sweep_http", "sweep_http_noseg"} and modes["sweep_http_noseg"]["segmented"] is False, lines
    assert all(m["cells"] > 0 for m in modes.values())
    with open(tmp_path / "p1" / "client-patched.json") as f:
        report = json.load(f)
    kinds = {e[0] for e in report["client_events"]}
    assert {"prepare", "add", "step"} <= kinds, kinds

    stacks = list((tmp_path / "p1").glob("stack-*-patched.json"))
    assert len(stacks) == 1, list((tmp_path / "p1").iterdir())
    with open(stacks[0]) as f:
        report = json.load(f)
    with open(model_path() / "config.json") as f:
        layers = json.load(f)["num_hidden_layers"]
    cells = layers * 3 * 16  # 16-token prompt: every layer x 3 hooks x 16 positions, one sampled call
    steps = [e for e in report["core_events"] if e[0] == "step"]
    assert steps and all(len(e) == 5 for e in steps)
    assert report["core_timeline"]["scheduled_tokens"] == sum(e[4] for e in steps) == 16 * cells, report["core_timeline"]


def test_dynamic_gaps_runs_and_reports_every_variant():
    """`benchmarks/diag/dynamic_gaps.py` (the device's idle time per decode step under dynamic
    steering): on the CPU no CUDA kernel is recorded, so each variant reports `kernels: 0`."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "diag" / "dynamic_gaps.py"), "--device", "cpu",
                           "--batch", "2", "--tokens", "4", "--variants", "vanilla,monitor_only", "--ab-device",
                           "--attribute"],
                          capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = [json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith('{"bench"')]
    gaps = [ln for ln in lines if ln["bench"] == "dyn_gaps"]
    assert [ln["variant"] for ln in gaps] == ["vanilla", "monitor_only", "monitor_only@device", "monitor_only@host"]
    assert all(ln["kernels"] == 0 and ln["tok_s_profiled"] > 0 for ln in gaps), gaps
    # --attribute: one gap_host line per variant (no device activity on the CPU: no gaps), no error
    host = [ln for ln in lines if ln["bench"] == "gap_host"]
    assert [(ln["variant"], ln.get("gaps")) for ln in host] == [(ln["variant"], 0) for ln in gaps], host


@pytest.mark.parametrize("server", ["stock", "cb"])
def test_http_bench_serves_and_reports(server):
    """`benchmarks/compare/http_bench.py`: stock vLLM's OpenAI server and `causalboard serve`
    started as subprocesses and driven by the same `/v1/completions` client (tiny sizes)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.run([sys.executable, str(BENCH / "http_bench.py"), "--server", server, "--model", str(model_path()),
                           "--device", "cpu", "--p1-requests", "16", "--tokens", "4", "--reps", "1", "--start-timeout", "300"],
                          capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = [json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith('{"bench"')]
    got = {(ln.get("task"), ln.get("batch")) for ln in lines if "task" in ln}
    assert got == {("p1", None), ("p2", 32), ("p2", 1)}, lines
    assert all(ln["bench"] == f"http_{server}" for ln in lines)
    assert [ln for ln in lines if ln.get("task") == "p1"][0]["req_per_s"] > 0

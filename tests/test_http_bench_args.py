"""`benchmarks/compare/http_bench.py`'s server command lines and its fallback wheels (fast tier: no
server started; the servers themselves run in tests/test_benchmark_smoke.py)."""

from __future__ import annotations

import subprocess
import sys
import zipfile

import pytest

from benchmarks.compare.http_bench import SERVER_MODULES, WITH_FALLBACK, server_command, unpack_fallback


def test_both_servers_search_the_fallback_after_site_packages(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    with zipfile.ZipFile(wheels / "cbfallbackprobe-1.0-py3-none-any.whl", "w") as z:
        z.writestr("cbfallbackprobe/__init__.py", "WHERE = 'fallback'\n")
        z.writestr("json/__init__.py", "raise ImportError('the fallback shadowed the standard library')\n")
    out = unpack_fallback(str(wheels))
    assert unpack_fallback(str(wheels)) == out  # unpacked once
    # the same bootstrap both servers run, with a module of the test's in place of a server
    (tmp_path / "cbprobe_main.py").write_text("import json, cbfallbackprobe, sys\n"
                                              "print(cbfallbackprobe.WHERE, sys.argv[0].endswith('cbprobe_main.py'), sys.argv[1:])\n")
    r = subprocess.run([sys.executable, "-c", WITH_FALLBACK, out, "cbprobe_main", "--model", "m"], capture_output=True,
                       text=True, cwd=tmp_path, env={"PYTHONPATH": str(tmp_path)}, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "fallback True ['--model', 'm']"

    cmd = server_command("stock", "/m", "cuda", 8123, fallback=out)
    assert cmd[1:5] == ["-c", WITH_FALLBACK, out, SERVER_MODULES["stock"]] and "--attention-backend" in cmd and "8123" in cmd
    assert server_command("stock", "/m", "cpu", 1)[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert server_command("cb", "/m", "cuda", 1, fallback=out)[1:6] == ["-c", WITH_FALLBACK, out, "app.cli.main", "serve"]
    cb = server_command("cb", "/m", "cuda", 1)
    assert cb[1:4] == ["-m", "app.cli.main", "serve"] and "--no-batch-invariant" in cb and "--compiled" in cb
    assert "--no-dashboard" in cb  # like stock: no dashboard (and no Panel needed on an engine-only host)
    from app.cli.main import build_parser

    parsed = build_parser().parse_args(cb[3:])  # the cb command line is one `causalboard serve` accepts
    assert parsed.dashboard is False and parsed.batch_invariant is False and parsed.eager is False


def test_no_wheels_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="no wheels"):
        unpack_fallback(str(tmp_path))


def test_cpu_per_request_reads_this_process_and_its_threads():
    """P1's CPU figures: two /proc readings of a process tree around some work give µs per request
    for the process (keyed `comm:pid`), its busiest threads and the client."""
    import os

    from benchmarks.compare.http_bench import cpu_per_request, cpu_reading

    before = cpu_reading(os.getpid())
    x = 0
    for i in range(2_000_000):  # ~0.1 s of CPU in this thread
        x += i
    after = cpu_reading(os.getpid())
    got = cpu_per_request(before, after, 1000)
    (key, us), = [(k, v) for k, v in got["us_cpu_per_req"].items() if k.endswith(f":{os.getpid()}")]
    assert us > 10 and got["api_threads_us"][0] > 10 and got["client_us_per_req"] > 10
    tick_us = 1e6 / os.sysconf("SC_CLK_TCK") / 1000  # /proc counts in clock ticks; threads are read after the process
    assert got["api_threads_us"][0] <= us + 2 * tick_us + 1


def test_the_switch_interval_diagnostic_sets_the_gil_interval_only_when_asked():
    """benchmarks/diag/switchinterval: `CB_SWITCH_INTERVAL` sets a process's GIL switch interval."""
    import os
    import subprocess
    import sys

    from tests.conftest import REPO

    def interval(value: str | None) -> float:
        env = {k: v for k, v in os.environ.items() if k != "CB_SWITCH_INTERVAL"}
        env["PYTHONPATH"] = str(REPO / "benchmarks/diag/switchinterval")
        if value is not None:
            env["CB_SWITCH_INTERVAL"] = value
        out = subprocess.run([sys.executable, "-c", "import sys; print(sys.getswitchinterval())"], env=env,
                             capture_output=True, text=True, timeout=60)
        return float(out.stdout)

    assert interval("0.0005") == 0.0005
    assert interval(None) == 0.005


def test_burst_cpu_splits_one_burst_by_process_and_thread():
    """Each P1 burst's CPU: [API process, its busiest thread, the next, the other processes]."""
    from benchmarks.compare.http_bench import burst_cpu

    before = ({"python3:1": 1.0, "python3:2": 0.0, "VLLM::EngineCor:3": 2.0}, {"1": 0.5, "7": 0.1, "8": 0.0}, 0.0)
    after = ({"python3:1": 1.768, "python3:2": 0.0, "VLLM::EngineCor:3": 2.384}, {"1": 1.1, "7": 0.2, "8": 0.0}, 0.1)
    assert burst_cpu(before, after, 768) == pytest.approx([1000.0, 781.25, 130.2, 500.0], abs=0.06)


def test_the_gc_stats_diagnostic_records_collections_only_when_asked(tmp_path):
    """benchmarks/diag/gcstats: `CB_GC_STATS` makes each process write its collections per
    generation, its oldest-generation pauses and its frozen objects."""
    import json
    import os
    import subprocess
    import sys

    from tests.conftest import REPO

    code = "import gc, time; gc.collect(); gc.collect(); time.sleep(2.5)"
    env = {k: v for k, v in os.environ.items() if k != "CB_GC_STATS"}
    env["PYTHONPATH"] = str(REPO / "benchmarks/diag/gcstats")
    prefix = tmp_path / "gc"
    out = subprocess.run([sys.executable, "-c", code], env={**env, "CB_GC_STATS": str(prefix)}, capture_output=True, timeout=60)
    assert out.returncode == 0, out.stderr
    (f,) = tmp_path.glob("gc.*")
    got = json.loads(f.read_text())
    assert got["per_generation"]["2"]["collections"] >= 2 and len(got["oldest_ms"]) >= 2 and got["frozen"] >= 0
    subprocess.run([sys.executable, "-c", "pass"], env=env, check=True, timeout=60)
    assert len(list(tmp_path.glob("gc.*"))) == 1, "without the variable nothing is written"


def test_summary_compares_servers_over_their_processes(tmp_path):
    """`http_summary.py` over a call's files: each process's median per task, the median over a
    server's processes, and causalboard over stock both from those medians and per round."""
    import json

    from benchmarks.compare.http_summary import read, summarise

    def write(name, b1, b32, p1=None):
        lines = ['{"bench": "http_x", "step": "ready", "seconds": 80.0}', "INFO some server log line"]
        if p1 is not None:
            lines.append(json.dumps({"bench": "http_x", "task": "p1", "requests": 768, "median_s": p1}))
        lines += [json.dumps({"bench": "http_x", "task": "p2", "batch": 32, "median_s": b32}),
                  json.dumps({"bench": "http_x", "task": "p2", "batch": 1, "median_s": b1})]
        (tmp_path / name).write_text("\n".join(lines) + "\n")

    write("http-stock-r1.out", 0.40, 0.60, p1=0.8)
    write("http-cb-r1.out", 0.50, 0.60, p1=0.4)
    write("http-stock-r2.out", 0.55, 0.80)
    write("http-cb-r2.out", 0.44, 0.50)
    write("http-cb-CAUSALBOARD_WAKE_LOOP_0-r1.out", 0.42, 0.55)
    rows = {(r["task"], r["server"]): r for r in summarise(read(sorted(str(p) for p in tmp_path.iterdir())))}
    b1 = rows[("p2_b1", "cb")]
    assert b1["process_medians_s"] == [0.50, 0.44] and b1["median_s"] == 0.47
    assert b1["vs_stock"] == round(0.475 / 0.47, 3)  # stock's median over its two processes
    assert b1["paired_ratios"] == [0.8, 1.25] and b1["paired_geomean"] == 1.0
    assert rows[("p2_b32", "cb")]["paired_ratios"] == [1.0, 1.6]
    assert rows[("p2_b1", "cb-CAUSALBOARD_WAKE_LOOP_0")]["paired_ratios"] == [round(0.40 / 0.42, 3)]
    assert rows[("p1", "cb")]["vs_stock"] == 2.0 and "vs_stock" not in rows[("p1", "stock")]
    # one process per server (no -rN): the same figures, one round
    single = tmp_path / "single"
    single.mkdir()
    (single / "http-stock.out").write_text((tmp_path / "http-stock-r1.out").read_text())
    (single / "http-cb.out").write_text((tmp_path / "http-cb-r1.out").read_text())
    rows = {(r["task"], r["server"]): r for r in summarise(read([str(single / "http-stock.out"), str(single / "http-cb.out")]))}
    assert rows[("p2_b1", "cb")]["paired_ratios"] == [0.8]

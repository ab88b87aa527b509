"""Fast tier: the step-times diagnostic (`benchmarks/diag/steptimes/sitecustomize.py`) wraps the
runner and worker-state methods it names as their modules load, and only when asked to."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import REPO

PROBE = ("import engine_ext.worker.state as s, vllm.v1.worker.gpu_model_runner as r; "
         "import vllm.v1.worker.gpu.async_utils as a, vllm.v1.core.sched.scheduler as c; "
         "import engine_ext.dynamic.worker as d, engine_ext.engine.facade as f, engine_ext.engine.loop as lp; "
         "import engine_ext.worker.seam as sm, engine_ext.engine.outputs as o; "
         "print(s.WorkerState.plan_step.__name__, s.WorkerState.after_forward.__name__, "
         "r.GPUModelRunner.execute_model.__name__, r.GPUModelRunner.sample_tokens.__name__, "
         "a.AsyncOutput.get_output.__name__, c.Scheduler.schedule.__name__, s.WorkerState.on_schedule.__name__, "
         "d.DynamicWorker.sync_device.__name__, f.Engine.generate.__name__, lp.EngineLoop._step.__name__, "
         "sm.start_collective_rpc.__name__, lp.EngineLoop._merge_started.__name__, o.QueueSink.on_output.__name__, "
         "o.QueueSink.convert.__name__)")


def _run(tmp_path, on: bool) -> list[str]:
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'benchmarks/diag/steptimes'}:{REPO}"}
    env.pop("CB_STEP_TIMES", None)
    if on:
        env["CB_STEP_TIMES"] = str(tmp_path)
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, cwd=tmp_path, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-1].split()  # vLLM logs to stdout before it


def test_the_step_times_diagnostic_wraps_what_it_names_only_when_asked(tmp_path):
    assert _run(tmp_path, on=True) == ["wrapper", "wrapper", "wrapper", "wrapper", "waited_get_output", "wrapper",
                                       "wrapper", "wrapper", "generate", "step", "start", "merge_started", "converting",
                                       "converting"]
    assert _run(tmp_path, on=False) == ["plan_step", "after_forward", "execute_model", "sample_tokens",
                                        "get_output", "schedule", "on_schedule", "sync_device", "generate", "_step",
                                        "start_collective_rpc", "_merge_started", "on_output", "convert"]


def test_the_client_timeline_summary_takes_medians_per_variant():
    import importlib.util

    spec = importlib.util.spec_from_file_location("steptimes_summary", REPO / "benchmarks/diag/steptimes/summary.py")
    summary = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(summary)
    recs = [{"steps": 4, "end": 10.0, "first_step": 2.0},
            {"steps": 4, "end": 14.0, "first_step": 3.0, "collect_sent": 11.0, "collect_reply": 12.0},
            {"steps": 4, "end": 12.0, "first_step": 4.0},
            {"steps": 4, "end": 18.0, "first_step": 5.0, "collect_sent": 13.0, "collect_reply": 16.0}]
    out = summary.summarize(recs, ["vanilla", "dyn"])
    assert out["vanilla"] == {"n": 2, "first_step_ms": 3.0, "collect_ms": None, "after_reply_ms": None, "generate_ms": 11.0}
    assert out["dyn"] == {"n": 2, "first_step_ms": 4.0, "collect_ms": 2.0, "after_reply_ms": 2.0, "generate_ms": 16.0}

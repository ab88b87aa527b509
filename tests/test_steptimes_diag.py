"""Fast tier: the step-times diagnostic (`benchmarks/diag/steptimes/sitecustomize.py`) wraps the
runner and worker-state methods it names as their modules load, and only when asked to."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import REPO

PROBE = ("import engine_ext.worker.state as s, vllm.v1.worker.gpu_model_runner as r; "
         "import vllm.v1.worker.gpu.async_utils as a, vllm.v1.core.sched.scheduler as c; "
         "print(s.WorkerState.plan_step.__name__, s.WorkerState.after_forward.__name__, "
         "r.GPUModelRunner.execute_model.__name__, r.GPUModelRunner.sample_tokens.__name__, "
         "a.AsyncOutput.get_output.__name__, c.Scheduler.schedule.__name__)")


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
    assert _run(tmp_path, on=True) == ["wrapper", "wrapper", "wrapper", "wrapper", "waited_get_output", "wrapper"]
    assert _run(tmp_path, on=False) == ["plan_step", "after_forward", "execute_model", "sample_tokens",
                                        "get_output", "schedule"]

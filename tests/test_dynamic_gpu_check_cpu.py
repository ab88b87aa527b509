"""`benchmarks/dynamic_gpu_check.py` on the CPU engine (it is the GPU's check of dynamic
steering): every check passes here too, including the single-policy runs that compare planning
request by request, repeated steady steps (`Replay`) and decisions taken on the device
(`device_decisions`, CPU tensors here), so the script cannot rot between GPU calls and the three
modes are compared on the real engine in every `make test`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.engine  # starts an engine of its own


def test_the_dynamic_gpu_check_passes_on_the_cpu_engine():
    env = {**os.environ, "PYTHONPATH": str(REPO), "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "dynamic_gpu_check.py"), "--device", "cpu",
                           "--tokens", "12"], capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    lines = [json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith("{")]
    failed = [ln for ln in lines if ln.get("ok") is False]
    assert proc.returncode == 0 and not failed, (failed, proc.stderr[-3000:])
    names = {ln.get("check") for ln in lines}
    assert {"single[threshold][device].equals_host", "single[proportional][replay].equals_host",
            "single[proportional][device].equals_host",
            "single[threshold].repeated", "single[proportional].repeated", "repeatable"} <= names
    assert lines[-1] == {"summary": "dynamic_gpu_check", "failures": 0}


def test_the_dynamic_gpu_check_passes_with_empty_steps_between():
    """The same check with an empty step (no rows: no plan, its `after_forward`) after every 5th
    step, as vLLM's asynchronous scheduling runs on a GPU once every request of a batch has reached
    its last token: inside chains of repeated steps and at their ends. Before the fix in
    `DynamicWorker.decide_pending` this failed here as it did on the H100 (traces out of order)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "dynamic_gpu_check.py"), "--device", "cpu",
                           "--tokens", "48", "--empty-steps"], capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    lines = [json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith("{")]
    failed = [ln for ln in lines if ln.get("ok") is False]
    assert proc.returncode == 0 and not failed, (failed, proc.stderr[-3000:])
    repeated = {ln["check"]: ln.get("steps_repeated") for ln in lines if ln.get("check", "").endswith("[replay].rule")}
    assert all(v and v > 0 for v in repeated.values()), repeated  # chains formed between the empty steps
    assert lines[-1] == {"summary": "dynamic_gpu_check", "failures": 0}

"""The Triton kernels of decisions taken on the device (`engine_ext/dynamic/device_kernels.py`)
equal their torch reference bit for bit, run under Triton's interpreter on the CPU (the GPU runs
them for real in `benchmarks/dynamic_gpu_check.py`, where the host takes every decision again and
compares). Fast tier: no engine."""
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")


def test_kernels_equal_the_torch_reference_under_the_interpreter():
    script = Path(__file__).with_name("device_kernels_interp.py")
    out = subprocess.run([sys.executable, str(script), "20"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "kernel == torch reference in 20 trials" in out.stdout

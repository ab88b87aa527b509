"""`runtime.prepare_environment`: the CPU engine's process defaults, never over the user's own."""
from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import REPO

PROBE = """
import os, sys
os.environ.pop("TORCHINDUCTOR_VEC_ISA_OK", None) if sys.argv[1] == "unset" else os.environ.__setitem__("TORCHINDUCTOR_VEC_ISA_OK", sys.argv[1])
from engine_ext.engine.runtime import prepare_environment
prepare_environment("cpu")
import torch._inductor.config as c
print(os.environ["TORCHINDUCTOR_VEC_ISA_OK"], c.cpp.vec_isa_ok)
"""


def _probe(value: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_VEC_ISA_OK"}
    out = subprocess.run([sys.executable, "-c", PROBE, value], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.split("\n")[-2]


def test_the_cpu_engine_trusts_the_cpus_vector_flags_unless_told_otherwise():
    """inductor's per-process ISA probes (a `python -c "import torch"` each, ~5 s of every CPU
    engine start) are skipped by default; `TORCHINDUCTOR_VEC_ISA_OK=0` keeps them."""
    assert _probe("unset") == "1 True"
    assert _probe("0") == "0 False"


def test_inductor_config_imported_before_the_defaults_gets_them_too():
    code = ("import os; os.environ.pop('TORCHINDUCTOR_VEC_ISA_OK', None); import torch._inductor.config as c; "
            "assert c.cpp.vec_isa_ok is None; from engine_ext.engine.runtime import prepare_environment; "
            "prepare_environment('cpu'); print(c.cpp.vec_isa_ok)")
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_VEC_ISA_OK"}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "True", out.stderr[-2000:]

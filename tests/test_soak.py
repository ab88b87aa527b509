"""The short soak (issue #18; `make soak` runs the long one): `benchmarks/soak.py` for 60 s on a
loopback server of its own — concurrent sweeps, steered streams, captures with keep_as, patches
from stored runs and clients that disconnect mid-stream, every result equal to its solo run
(within the noise floor), the source store within its budget with evictions turning into voided
patches, nothing left in flight, RSS flat after warm-up, and a clean exit on SIGTERM."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from .conftest import REPO

pytestmark = pytest.mark.engine  # starts a server (and engine) of its own

DURATION_S = 60


def test_short_soak(tmp_path):
    out = tmp_path / "soak.json"
    proc = subprocess.run([sys.executable, "benchmarks/soak.py", "--duration", str(DURATION_S), "--workers", "4",
                           "--out", str(out), "--log", str(tmp_path / "server.log")],
                          cwd=REPO, capture_output=True, text=True, timeout=900)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert proc.returncode == 0 and report["ok"], report["failures"]
    assert report["errors"] == 0 and report["server_exit_code"] == 0
    kinds = report["by_kind"]
    for kind in ("sweep", "steer", "capture", "patch", "disconnect"):
        assert kinds.get(kind, 0) >= 1, kinds  # every workload ran
    assert report["cells_served"] > 0
    assert report["source_store_max_used_bytes"] <= report["source_store_budget_bytes"]
    assert report["evictions"] >= 1  # the small store did evict: the voided-patch path was live

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
    # RSS flatness needs the long run (`make soak`; its growth is an open finding, docs/reliability.md):
    # a 60 s run is mostly warm-up, so only a gross leak fails it here
    proc = subprocess.run([sys.executable, "benchmarks/soak.py", "--duration", str(DURATION_S), "--workers", "4",
                           "--rss-tolerance-mb", "256",
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


def test_a_cancel_while_a_finished_sweep_logs_its_summary_does_not_leave_it_running(engine):
    """Found by the soak: a client that disconnected while its (finished) sweep was logging its
    final checksum and summary cancelled the fan-out inside its cleanup; the sweep then stayed
    'running' forever (cells all done, no summary). A cancel must not reach a finishing sweep."""
    import asyncio

    from app.sweep.schema import PatchSweepRequest
    from app.sweep.service import SweepService

    async def main():
        service = SweepService(engine)
        reached, gate = asyncio.Event(), asyncio.Event()
        calls = 0
        emit_checksum = service._emit_checksum

        async def paused_checksum(run):
            nonlocal calls
            calls += 1
            if calls == 2:  # the final checksum, logged in the fan-out's cleanup
                reached.set()
                await gate.wait()
            await emit_checksum(run)

        service._emit_checksum = paused_checksum
        run = await service.start(PatchSweepRequest(prompt="Garrow is ruled by", clean_prompt="Guzar is ruled by",
                                                    answer_token=" Hadrian", layers=[0, 1], stream=True))
        await asyncio.wait_for(reached.wait(), 120)
        run.cancel()  # the stream's client goes away now
        gate.set()
        await asyncio.wait_for(asyncio.shield(run.task), 60)
        return run

    run = asyncio.run(main())
    assert run.state == "done" and run.summary is not None and not run.summary.cancelled
    assert run.log[-1][1]["type"] == "summary"

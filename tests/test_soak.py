"""The short soak (issue #18; `make soak` runs the long one): `benchmarks/soak.py` for 60 s on a
loopback server of its own — concurrent sweeps, steered streams, captures with keep_as, patches
from stored runs and clients that disconnect mid-stream, every result equal to its solo run
(within the noise floor), the source store within its budget with evictions turning into voided
patches, nothing left in flight, RSS flat after warm-up, and a clean exit on SIGTERM."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from .conftest import REPO

pytestmark = pytest.mark.engine  # starts a server (and engine) of its own

DURATION_S = 60

#: a fresh engine process: warm-up, then batches of many different token counts (what sweeps
#: send); prints the growth of glibc's heap in use (`mallinfo2().uordblks`) over those batches
HEAP_PROBE = r"""
import ctypes, json, random, sys
from engine_ext import Engine, EngineConfig, GenerationParams
class MI(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MI
rng = random.Random(0)
with Engine(EngineConfig(device="cpu")) as eng:
    vocab = eng.info.vocab_size
    def batch(tokens):  # prompts of 3-19 tokens adding up to `tokens`, one token generated each
        prompts = []
        while tokens >= 3:
            n = min(tokens, rng.randrange(3, 20))
            n = tokens if tokens - n < 3 else n
            prompts.append([rng.randrange(5, vocab) for _ in range(n)])
            tokens -= n
        eng.generate(prompts, GenerationParams(max_tokens=1))
    for tokens in (40, 41, 42, 43):  # warm-up
        batch(tokens)
    before = libc.mallinfo2().uordblks
    for tokens in rng.sample(range(50, 2050), int(sys.argv[1])):
        batch(tokens)
    after = libc.mallinfo2().uordblks
print(json.dumps({"growth_mib": (after - before) / 2**20}))
"""


def test_short_soak(tmp_path):
    out = tmp_path / "soak.json"
    # RSS flatness needs the long run (`make soak`, docs/reliability.md): a 60 s run is mostly
    # warm-up, so only a gross leak fails it here (the heap test below catches the oneDNN cache)
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


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallinfo2")
def test_the_heap_stays_bounded_under_many_batch_sizes():
    """Found by the soak (its RSS grew ~240 MiB in 450 s with no plateau): oneDNN's process-wide
    primitive cache (1024 entries by default) keeps a compiled matmul per linear layer and batch
    token count, so every new batch size of a sweep grew the heap until ~200 MiB. The engine now
    caps it (`runtime.ONEDNN_PRIMITIVE_CACHE_CAPACITY`): 120 batches of distinct token counts in a
    fresh engine process grow the heap in use by far less."""
    env = {k: v for k, v in os.environ.items() if not k.endswith("PRIMITIVE_CACHE_CAPACITY")}
    proc = subprocess.run([sys.executable, "-c", HEAP_PROBE, "120"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    growth = json.loads(proc.stdout.strip().splitlines()[-1])["growth_mib"]
    assert growth < 48, f"the heap in use grew {growth:.1f} MiB over 120 batch sizes"


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
        read_checksum = service._read_checksum

        async def paused_checksum():
            nonlocal calls
            calls += 1
            if calls == 2:  # the final checksum, read in the fan-out's cleanup
                reached.set()
                await gate.wait()
            return await read_checksum()

        service._read_checksum = paused_checksum
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

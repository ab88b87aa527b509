"""Soak run (issue #18): a loopback `causalboard serve` on the bundled model (CPU) under mixed
concurrent load for a fixed duration, every result checked against its solo run.

    .venv/bin/python benchmarks/soak.py --duration 600 --out soak.json      # `make soak`
    .venv/bin/python benchmarks/soak.py --duration 60                       # the test suite's short run

What it does:

1. starts `causalboard serve` on 127.0.0.1 (`--port 0`: a free port the server binds) with a small source-run store
   (`--source-store-mb`, default 0.5 MiB) so that stored runs are evicted during the run;
2. solo references, one request at a time: a patch sweep per fact pair, a steered generation per
   prompt, a capture per prompt, and a generation patched from a stored capture;
3. for `--duration` seconds, `--workers` concurrent clients each pick (seeded) one of:
   * `sweep`     — a streamed patch sweep read to its end; every cell equal to the solo sweep's
                   within the noise floor (max of the two runs' measured floors, at least 1e-5);
   * `steer`     — a streamed steered generation; token ids equal, logprobs within 1e-4;
   * `capture`   — a capture stored with `keep_as` (a fresh id each time: the store fills and
                   evicts); values within 1e-4 of the solo capture;
   * `patch`     — a generation patched from a run stored a while ago: either status `ok` with
                   the solo patched result (the run was still stored), or `voided` naming the
                   missing run — never an unpatched value reported as patched;
   * `disconnect`— a streamed sweep or generation closed after a few events (the server must
                   cancel it: nothing left in flight at the end);
4. samples, once a second, the server's RSS (its process and children) and the source store
   (`used_bytes` must stay within `budget_bytes`);
5. at the end: nothing in flight, no sweep active, the server healthy; RSS after warm-up (the
   first `--warmup` fraction of the run) may grow at most `--rss-tolerance-mb`.

Prints and writes (`--out`) one JSON report; exits 1 when any check failed (the report lists
which). Stops by itself; talks to 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import psutil

REPO = Path(__file__).resolve().parents[1]
LOGPROB_TOL = 1e-4
CAPTURE_TOL = 1e-4
MIN_FLOOR = 1e-5
STEER_LAYERS = (1, 3, 5)
CAPTURE_SITES = ["L1.post_block", "L4.post_attn", "L6.pre_attn"]
PATCH_SITE = "L3.post_block"
#: after the load stops, the server must have nothing in flight and no sweep active within this
SETTLE_S = 30.0
#: the report keeps every n-th RSS sample (one a second)
RSS_SERIES_EVERY = 15


def rss_bytes(pid: int) -> int:
    """RSS of the server process and its children (vLLM may run helpers)."""
    try:
        proc = psutil.Process(pid)
        procs = [proc] + proc.children(recursive=True)
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


class Soak:
    def __init__(self, args: argparse.Namespace, url: str, pid: int):
        self.args = args
        self.url = url
        self.pid = pid
        self.rng = random.Random(args.seed)
        tasks = json.loads((REPO / "engine_ext/bundled/causalboard-tiny/tasks.json").read_text())
        self.pairs = [p for p in tasks["pairs"] if p.get("equal_length") and p.get("hf_top1", True)][: args.pairs]
        self.prompts = [p["corrupt_prompt"] for p in self.pairs]
        self.counts: dict[str, int] = {}
        self.cells = 0
        self.voided_cells = 0
        self.voided_patches = 0
        self.ok_patches = 0
        self.failures: list[str] = []
        self.max_dev = {"sweep": 0.0, "steer": 0.0, "capture": 0.0, "patch": 0.0}
        self.rss: list[tuple[float, int]] = []
        self.store_max_used = 0
        self.store_budget = 0
        self.evictions = 0
        self.stored: list[str] = []  # keep_as ids in the order they were stored
        self.next_id = 0
        self.ref: dict = {}

    # ---- helpers ---------------------------------------------------------------------------
    def fail(self, what: str) -> None:
        if len(self.failures) < 50:
            self.failures.append(what)
        print(f"soak: FAIL {what}", file=sys.stderr, flush=True)

    def count(self, kind: str) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + 1

    def sweep_body(self, pair: dict) -> dict:
        return {"prompt": pair["corrupt_prompt"], "clean_prompt": pair["clean_prompt"], "answer_token": " " + pair["answer"],
                "foil_token": " " + pair["foil"], "metric": "logit_diff", "hooks": ["post_attn", "post_block"],
                "noise_floor_samples": 2, "stream": True}

    def steer_body(self, k: int) -> dict:
        vec = np.random.default_rng(k).standard_normal(self.hidden).astype(np.float32) * 0.5
        return {"prompt": self.prompts[k % len(self.prompts)], "max_tokens": 8, "logprobs": 0, "ignore_eos": True, "stream": True,
                "interventions": {"steer": [{"sites": f"L{STEER_LAYERS[k % len(STEER_LAYERS)]}.post_block",
                                             "vector": vec.tolist(), "scale": 4.0}]}}

    def patch_body(self, k: int, run_id: str) -> dict:
        return {"prompt": self.pairs[k]["corrupt_prompt"], "max_tokens": 1, "logprobs": 5,
                "interventions": {"patch": [{"site": PATCH_SITE, "positions": "all_prompt", "source": {"run": run_id}}]}}

    async def read_sse(self, client: httpx.AsyncClient, path: str, body: dict, stop_after: int | None = None) -> list:
        events = []
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"{path}: HTTP {r.status_code} {(await r.aread())[:300]!r}")
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    data = line[6:]
                    events.append(data if data == "[DONE]" else json.loads(data))
                    if stop_after is not None and len(events) >= stop_after:
                        return events  # leaving the block closes the connection mid-stream
        return events

    async def capture(self, client: httpx.AsyncClient, k: int, keep_as: str | None) -> dict:
        body = {"prompt": self.pairs[k]["clean_prompt"], "sites": CAPTURE_SITES, "positions": "all_prompt", "keep_as": keep_as}
        r = await client.post("/v1/capture", json=body)
        if r.status_code != 200:
            raise RuntimeError(f"capture: HTTP {r.status_code} {r.text[:300]}")
        return r.json()

    async def store_patch_source(self, client: httpx.AsyncClient, k: int, keep_as: str) -> None:
        body = {"prompt": self.pairs[k]["clean_prompt"], "sites": [PATCH_SITE], "positions": "all_prompt", "keep_as": keep_as,
                "return_values": False}
        r = await client.post("/v1/capture", json=body)
        if r.status_code != 200:
            raise RuntimeError(f"capture keep_as: HTTP {r.status_code} {r.text[:300]}")

    # ---- solo references -----------------------------------------------------------------------
    async def references(self, client: httpx.AsyncClient) -> None:
        status = (await client.get("/v1/status")).json()
        self.hidden = status["hidden_size"]
        self.store_budget = status["source_store"]["budget_bytes"]
        self.ref["sweep"] = {}
        for k, pair in enumerate(self.pairs):
            events = await self.read_sse(client, "/v1/patch_sweep", self.sweep_body(pair))
            self.ref["sweep"][k] = next(e for e in events if isinstance(e, dict) and e.get("type") == "summary")
        self.ref["steer"] = {}
        for k in range(len(self.pairs) * len(STEER_LAYERS)):
            events = await self.read_sse(client, "/v1/generate", self.steer_body(k))
            self.ref["steer"][k] = next(e for e in events if isinstance(e, dict) and e.get("type") == "done")
        self.ref["capture"] = {k: await self.capture(client, k, None) for k in range(len(self.pairs))}
        self.ref["patch"] = {}
        for k in range(len(self.pairs)):
            run_id = f"soak-ref-{k}"
            await self.store_patch_source(client, k, run_id)
            r = (await client.post("/v1/generate", json=self.patch_body(k, run_id))).json()
            if r["intervention"]["status"] != "ok":
                raise RuntimeError(f"reference patch voided: {r['intervention']}")
            self.ref["patch"][k] = r
            await client.delete(f"/v1/patch_source/{run_id}")

    # ---- workloads -----------------------------------------------------------------------------
    async def do_sweep(self, client: httpx.AsyncClient) -> None:
        k = self.rng.randrange(len(self.pairs))
        try:
            events = await self.read_sse(client, "/v1/patch_sweep", self.sweep_body(self.pairs[k]))
        except RuntimeError as exc:
            if "HTTP 507" in str(exc):  # its clean run did not fit beside the leased runs: refused, not wrong
                self.count("sweep_refused_507")
                return
            raise
        if events[-1] != "[DONE]":
            return self.fail(f"sweep {k}: stream did not end with [DONE]")
        summary = next((e for e in events if isinstance(e, dict) and e.get("type") == "summary"), None)
        errors = [e for e in events if isinstance(e, dict) and e.get("type") == "error"]
        if summary is None or errors or summary.get("cancelled"):
            return self.fail(f"sweep {k}: failed: {errors or summary}")
        ref = self.ref["sweep"][k]
        tol = max(ref.get("noise_floor") or 0.0, summary.get("noise_floor") or 0.0, MIN_FLOOR)
        grids = [(g["grid"], r["grid"]) for g, r in zip(summary.get("hook_grids") or [summary], ref.get("hook_grids") or [ref])]
        for grid, ref_grid in grids:
            for row, ref_row in zip(grid, ref_grid):
                for v, rv in zip(row, ref_row):
                    self.cells += 1
                    if v is None:
                        self.voided_cells += 1
                        continue
                    dev = abs(v - rv)
                    self.max_dev["sweep"] = max(self.max_dev["sweep"], dev)
                    if dev > tol:
                        self.fail(f"sweep {k}: cell {v} vs solo {rv} (|d| {dev:.3g} > floor {tol:.3g})")
        nulls = sum(v is None for grid, _ in grids for row in grid for v in row)
        if nulls != summary["cells_voided"]:
            self.fail(f"sweep {k}: {nulls} null cells but cells_voided = {summary['cells_voided']}")

    async def do_steer(self, client: httpx.AsyncClient) -> None:
        k = self.rng.randrange(len(self.ref["steer"]))
        events = await self.read_sse(client, "/v1/generate", self.steer_body(k))
        done = next((e for e in events if isinstance(e, dict) and e.get("type") == "done"), None)
        ref = self.ref["steer"][k]
        if done is None or events[-1] != "[DONE]":
            return self.fail(f"steer {k}: no result: {events[-2:]}")
        if done["token_ids"] != ref["token_ids"]:
            return self.fail(f"steer {k}: tokens {done['token_ids']} vs solo {ref['token_ids']}")
        dev = max(abs(a - b) for a, b in zip(done["logprobs"], ref["logprobs"]))
        self.max_dev["steer"] = max(self.max_dev["steer"], dev)
        if dev > LOGPROB_TOL:
            self.fail(f"steer {k}: logprobs differ by {dev:.3g}")

    async def do_capture(self, client: httpx.AsyncClient) -> None:
        k = self.rng.randrange(len(self.pairs))
        keep_as = f"soak-{self.next_id}-{k}"
        self.next_id += 1
        try:
            got = await self.capture(client, k, keep_as)
        except RuntimeError as exc:
            if "HTTP 507" in str(exc):  # the store is full of leased runs: refused, not wrong
                self.count("capture_refused_507")
                return
            raise
        self.stored.append(keep_as)
        ref = self.ref["capture"][k]
        for site, rows in ref["captures"].items():
            dev = float(np.max(np.abs(np.asarray(got["captures"][site]) - np.asarray(rows))))
            self.max_dev["capture"] = max(self.max_dev["capture"], dev)
            if dev > CAPTURE_TOL:
                self.fail(f"capture {k} {site}: differs from solo by {dev:.3g}")

    async def do_patch(self, client: httpx.AsyncClient) -> None:
        k = self.rng.randrange(len(self.pairs))
        run_id = f"soak-p{self.next_id}-{k}"
        self.next_id += 1
        try:
            await self.store_patch_source(client, k, run_id)
        except RuntimeError as exc:
            if "HTTP 507" not in str(exc):
                raise
            self.count("capture_refused_507")  # the store is full of leased runs: refused, not wrong
            return
        self.stored.append(run_id)
        # patch from an older run of the same pair when there is one (likely evicted by now)
        older = [r for r in self.stored[:-1] if r.startswith("soak-p") and r.endswith(f"-{k}")]
        use = self.rng.choice(older) if older and self.rng.random() < 0.5 else run_id
        r = await client.post("/v1/generate", json=self.patch_body(k, use))
        if r.status_code != 200:
            return self.fail(f"patch {k}: HTTP {r.status_code} {r.text[:200]}")
        body = r.json()
        iv = body["intervention"]
        if iv["status"] == "voided":
            self.voided_patches += 1
            if not iv["errors"] or not any(use in e for e in iv["errors"]):
                self.fail(f"patch {k}: voided without naming run {use}: {iv['errors']}")
            return
        if iv["status"] != "ok":
            return self.fail(f"patch {k}: status {iv['status']}")
        self.ok_patches += 1
        ref = self.ref["patch"][k]
        if body["token_ids"] != ref["token_ids"]:
            return self.fail(f"patch {k} from {use}: tokens {body['token_ids']} vs solo {ref['token_ids']} (wrong value)")
        dev = max(abs(a - b) for a, b in zip(body["logprobs"], ref["logprobs"]))
        self.max_dev["patch"] = max(self.max_dev["patch"], dev)
        if dev > LOGPROB_TOL:
            self.fail(f"patch {k} from {use}: logprob differs from solo by {dev:.3g} (wrong value)")

    async def do_disconnect(self, client: httpx.AsyncClient) -> None:
        if self.rng.random() < 0.5:
            try:
                await self.read_sse(client, "/v1/patch_sweep", self.sweep_body(self.rng.choice(self.pairs)), stop_after=3)
            except RuntimeError as exc:
                if "HTTP 507" not in str(exc):
                    raise
                self.count("sweep_refused_507")  # its clean run did not fit beside the leased runs: refused, not wrong
        else:
            await self.read_sse(client, "/v1/generate", {**self.steer_body(self.rng.randrange(len(self.ref["steer"]))),
                                                         "max_tokens": 60}, stop_after=2)

    async def worker(self, client: httpx.AsyncClient, deadline: float) -> None:
        kinds = ["sweep", "steer", "capture", "patch", "disconnect"]
        weights = [2, 3, 3, 3, 1]
        while time.monotonic() < deadline:
            kind = self.rng.choices(kinds, weights)[0]
            try:
                await getattr(self, f"do_{kind}")(client)
                self.count(kind)
            except Exception as exc:  # noqa: BLE001 - every unexpected error is a finding
                self.count("errors")
                self.fail(f"{kind}: {type(exc).__name__}: {exc}")

    async def sampler(self, client: httpx.AsyncClient, deadline: float) -> None:
        while time.monotonic() < deadline:
            self.rss.append((time.monotonic(), rss_bytes(self.pid)))
            try:
                store = (await client.get("/v1/status")).json()["source_store"]
                self.store_max_used = max(self.store_max_used, store["used_bytes"])
                self.evictions = store["evictions"]
                if store["used_bytes"] > store["budget_bytes"]:
                    self.fail(f"source store over budget: {store['used_bytes']} > {store['budget_bytes']}")
            except Exception as exc:  # noqa: BLE001
                self.fail(f"status: {type(exc).__name__}: {exc}")
            await asyncio.sleep(1.0)

    @staticmethod
    def worker_state(status: dict) -> list[dict]:
        return [{k: w.get(k) for k in ("tp_rank", "registered_requests", "slots_in_use", "buffer_bytes")}
                for w in (status.get("checksum") or {}).get("workers", [])]

    async def run(self) -> dict:
        limits = httpx.Limits(max_connections=self.args.workers + 4)
        async with httpx.AsyncClient(base_url=self.url, timeout=300, limits=limits) as client:
            t_ref = time.monotonic()
            await self.references(client)
            ref_s = time.monotonic() - t_ref
            start = time.monotonic()
            deadline = start + self.args.duration
            await asyncio.gather(self.sampler(client, deadline),
                                 *(self.worker(client, deadline) for _ in range(self.args.workers)))
            elapsed = time.monotonic() - start
            # the server settles: cancelled (disconnected) sweeps finish their cleanup
            settle_deadline = time.monotonic() + SETTLE_S
            while True:
                status = (await client.get("/v1/status")).json()
                if (status["in_flight_requests"] == 0 and status["sweeps"]["active"] == 0) or time.monotonic() > settle_deadline:
                    break
                await asyncio.sleep(0.2)
            settle_s = time.monotonic() - start - elapsed
            # vLLM tells the workers about finished/aborted requests with the next scheduled step;
            # after the last abort there may be none: one tiny request delivers them
            before_flush = self.worker_state(status)
            await client.post("/v1/generate", json={"prompt": self.prompts[0], "max_tokens": 1})
            status = (await client.get("/v1/status")).json()
            healthy = (await client.get("/health")).status_code == 200
        if status["in_flight_requests"] != 0:
            self.fail(f"{status['in_flight_requests']} requests still in flight {SETTLE_S} s after the end")
        if status["sweeps"]["active"] != 0:
            self.fail(f"{status['sweeps']['active']} sweeps still active {SETTLE_S} s after the end: {status['sweeps']['sweeps']}")
        if not healthy:
            self.fail("/health is not 200 at the end")
        workers = self.worker_state(status)
        for w in workers:  # every finished or aborted request's worker state was freed
            if w["registered_requests"] or w["slots_in_use"]:
                self.fail(f"worker state left behind after the load: {w}")
        self.rss.append((time.monotonic(), rss_bytes(self.pid)))
        warm_at = start + self.args.warmup * self.args.duration
        warm = [r for t, r in self.rss if t >= warm_at] or [self.rss[-1][1]]
        warm_rss = warm[0]
        peak_rss = max(r for _, r in self.rss)
        final_rss = self.rss[-1][1]
        growth = max(warm) - warm_rss
        if growth > self.args.rss_tolerance_mb * 2**20:
            self.fail(f"RSS grew {growth / 2**20:.1f} MiB after warm-up (tolerance {self.args.rss_tolerance_mb} MiB)")
        total = sum(v for k, v in self.counts.items() if k in ("sweep", "steer", "capture", "patch", "disconnect"))
        return {
            "ok": not self.failures,
            "duration_s": round(elapsed, 1),
            "reference_s": round(ref_s, 1),
            "settle_s": round(settle_s, 2),
            "workers": self.args.workers,
            "requests": total,
            "by_kind": dict(sorted(self.counts.items())),
            "cells_served": self.cells,
            "voided_cells": self.voided_cells,
            "patches_ok": self.ok_patches,
            "patches_voided": self.voided_patches,
            "errors": self.counts.get("errors", 0),
            "failures": self.failures,
            "max_deviation_from_solo": self.max_dev,
            "source_store_budget_bytes": self.store_budget,
            "source_store_max_used_bytes": self.store_max_used,
            "evictions": status["source_store"]["evictions"],
            "rss_mib": {"after_warmup": round(warm_rss / 2**20, 1), "peak": round(peak_rss / 2**20, 1),
                        "final": round(final_rss / 2**20, 1), "growth_after_warmup": round(growth / 2**20, 1),
                        "tolerance": self.args.rss_tolerance_mb},
            "workers_at_end": workers,
            "workers_before_flush": before_flush,
            "rss_series_mib": [[round(t - start, 1), round(r / 2**20, 1)] for t, r in self.rss[::RSS_SERIES_EVERY]],
            "server": {"model": status["model"], "device": status["device"], "dtype": status["dtype"],
                       "versions": status["versions"]},
        }


def start_server(args: argparse.Namespace, log_path: Path) -> tuple[subprocess.Popen, str]:
    """`causalboard serve --port 0`: the server binds a free port before its engine starts and
    prints it (a port picked here could be taken by another process while the engine loads)."""
    # this checkout's CLI (`-m` from the repository root), whichever checkout the venv's script points at
    cmd = [sys.executable, "-m", "app.cli.main", "serve", "--host", "127.0.0.1", "--port", "0", "--device", "cpu", "--log-level", "warning",
           "--source-store-mb", str(args.source_store_mb)]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(cmd, stdout=open(log_path, "w"), stderr=subprocess.STDOUT, cwd=REPO, env=env)
    deadline = time.time() + args.start_timeout
    url = None
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}):\n{log_path.read_text()[-3000:]}")
        if url is None:
            found = re.search(r"then serving on (http://\S+)", log_path.read_text())
            url = found.group(1) if found else None
        try:
            if url is not None and httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if time.time() > deadline:
            proc.kill()
            raise RuntimeError("the server did not come up")
        time.sleep(0.5)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=600.0, help="seconds of concurrent load (after the solo references)")
    p.add_argument("--workers", type=int, default=6, help="concurrent clients")
    p.add_argument("--pairs", type=int, default=3, help="fact pairs (prompts) used")
    p.add_argument("--source-store-mb", type=float, default=0.5, help="the server's source-store budget (small: evictions)")
    p.add_argument("--warmup", type=float, default=0.25, help="fraction of the run before RSS must stay flat")
    p.add_argument("--rss-tolerance-mb", type=float, default=64.0, help="allowed RSS growth after warm-up")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--out", default=None, help="write the JSON report here")
    p.add_argument("--log", default="soak-server.log", help="the server's log")
    args = p.parse_args(argv)
    proc, url = start_server(args, Path(args.log))
    try:
        report = asyncio.run(Soak(args, url, proc.pid).run())
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = None
    report["server_exit_code"] = code
    if code != 0:
        report["ok"] = False
        report["failures"].append(f"the server exited with {code} on SIGTERM")
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

"""P1 and P2 over HTTP, like for like: stock vLLM's OpenAI server (`vllm serve`) against
`causalboard serve`, the same client, the same `/v1/completions` requests, no interventions
(issue 13: "causalboard's engine and `causalboard serve` over HTTP ≥ 0.95x stock vLLM").

    python3 benchmarks/compare/http_bench.py --server stock --model DIR [--device cuda] [--tasks p1,p2] [--reps 5]
    python3 benchmarks/compare/http_bench.py --server cb --model DIR [--device cuda] ...
        [--server-args '--multiprocess']   # extra flags for the server's command line

One server per process of this script (started as a subprocess on a free port, stopped at the
end); run both in the same device call and compare. The client is aiohttp's (`--client httpx`:
httpx's, which the calls before 2026-11-28's eighteenth session used; at P1's 768 concurrent
requests it, not either server, set the pace). The offline GPU host's bundle has what offline
generation imports, not all of what vLLM's server does: `--fallback-wheels .gpu_server` (made here
by `scripts/gpu/server_extra.sh`, carried) fills the gaps without shadowing the host's packages,
for both servers alike (among them `uvloop`, whose event loop both servers use where it can be
imported: the fourteenth session's GPU call gave it to `vllm serve` only). On a GPU both serve with CUDA graphs, bf16,
prefix caching, the TRITON_ATTN attention backend and no batch invariance (vLLM's default;
`causalboard serve --no-batch-invariant`); neither logs requests; causalboard serves no dashboard
(`--no-dashboard`: stock has none, and the GPU bundle has no Panel). On the CPU both serve as
causalboard's CPU engine does by default: fp32 and eager (stock gets `--dtype float32
--enforce-eager`; without them it served the bundled model in its config's bf16 and compiled it,
~60 s more to start).

p1  768 one-token completions (`max_tokens` 1, greedy) of one 16-token prompt of random ids (seed 0),
    all sent at once: requests/s over the burst (`--p1-requests N` for another count); with it, over
    the timed bursts, µs of CPU per request of each server process, of the API process's busiest
    threads (its event loop first) and of this client (read from /proc, as `diag/serve_cpu.py` does),
    and each burst's (`burst_cpu_us`: API process, event loop, engine-loop thread, the other server
    processes; a burst stalled by one thread shows there, not in the averages).
p2  decode: batch 32 and batch 1, distinct random 16-token prompts (seed 100+batch), 256 tokens
    (`--tokens`), `ignore_eos`: generated tokens/s over the batch.

Each task: one warm-up, then `--reps` timed repetitions; one JSON line per task and batch with
the median and every repetition. Responses are checked (one choice each, the token count).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # app.client.notebook.free_port, when run without the project on PYTHONPATH


def emit(tag: str, **kw) -> None:
    print(json.dumps({"bench": tag, **kw}), flush=True)


#: runs the server module named by `sys.argv[2]` with `sys.argv[1]` appended to `sys.path` AFTER
#: site-packages (the module then sees the rest of the command line as its own)
WITH_FALLBACK = ("import runpy, sys; sys.path.append(sys.argv.pop(1)); sys.argv[0] = sys.argv.pop(1); "
                 "runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)")
SERVER_MODULES = {"stock": "vllm.entrypoints.openai.api_server", "cb": "app.cli.main"}


def unpack_fallback(wheels: str) -> str:
    """Unpack the wheels in `wheels` (scripts/gpu/server_extra.sh) once into a folder under /tmp
    named by their file names; returns it."""
    import hashlib
    import zipfile

    files = sorted(Path(wheels).glob("*.whl"))
    if not files:
        raise SystemExit(f"--fallback-wheels: no wheels in {wheels} (scripts/gpu/server_extra.sh makes them)")
    out = Path("/tmp") / ("cb-server-fallback-" + hashlib.sha256("|".join(f.name for f in files).encode()).hexdigest()[:12])
    if not (out / ".done").exists():
        for f in files:
            with zipfile.ZipFile(f) as z:
                z.extractall(out)
        (out / ".done").touch()
    return str(out)


def server_command(kind: str, model: str, device: str, port: int, fallback: str | None = None) -> list[str]:
    """The command line that serves `model` on `port` (`kind`: stock or cb). `fallback`: a folder
    of packages the server may import from when the interpreter lacks them."""
    module = SERVER_MODULES[kind]
    head = [sys.executable, "-c", WITH_FALLBACK, fallback, module] if fallback else [sys.executable, "-m", module]
    if kind == "stock":
        cmd = head + ["--model", model, "--host", "127.0.0.1",
               "--port", str(port), "--seed", "0", "--enable-prefix-caching", "--disable-uvicorn-access-log",
               "--disable-log-stats"]
        if device == "cuda":
            cmd += ["--dtype", "bfloat16", "--attention-backend", "TRITON_ATTN", "--gpu-memory-utilization", "0.8",
                    "--max-model-len", "4096"]
        else:  # causalboard's CPU defaults (engine_ext/engine/runtime.py): fp32, eager
            cmd += ["--dtype", "float32", "--enforce-eager"]
        return cmd
    cmd = head + ["serve", "--model", model, "--host", "127.0.0.1", "--port", str(port),
           "--log-level", "warning", "--no-dashboard"]  # stock serves no dashboard either
    if device == "cuda":
        cmd += ["--device", "cuda", "--compiled", "--no-batch-invariant", "--max-model-len", "4096"]
    else:
        cmd += ["--device", "cpu"]
    return cmd


def wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> str:
    """Poll `/health` until the server answers 200; return the served model's name."""
    import httpx

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"the server was not ready after {timeout:.0f} s")


async def burst(post, name: str, prompts: list[list[int]], max_tokens: int) -> float:
    """All `prompts` as concurrent completions through `post` (path, body -> the answer's JSON);
    seconds until the last one is back."""
    async def one(p):
        body = await post("/v1/completions", {"model": name, "prompt": p, "max_tokens": max_tokens,
                                              "temperature": 0.0, "ignore_eos": True})
        assert len(body["choices"]) == 1, str(body)[:300]
        return body.get("usage", {}).get("completion_tokens")

    t = time.perf_counter()
    counts = await asyncio.gather(*(one(p) for p in prompts))
    seconds = time.perf_counter() - t
    assert all(c in (None, max_tokens) for c in counts), counts[:8]
    return seconds


@contextlib.asynccontextmanager
async def http_client(url: str, kind: str, connections: int):
    """`post(path, body)` -> the answer's JSON, over one pool of keep-alive connections: aiohttp's
    client (the default: its per-request cost is small beside either server's), or httpx's (what
    the fourteenth to eighteenth sessions' calls used: at 768 concurrent requests it cost more than
    the servers themselves, ~9 ms a request on the GPU host, so P1 over HTTP measured ~110 req/s
    for both servers)."""
    from app.client.http import KEEPALIVE_EXPIRY_S

    if kind == "aiohttp":
        import aiohttp

        # aiohttp reuses its oldest idle connection first: one idle past the server's keep-alive
        # (uvicorn's 5 s, both servers) can be closed under the request (ServerDisconnectedError, seen
        # at P2 batch 1 after P1's 776 connections idled ~5.6 s). Retire them first, as our client does.
        connector = aiohttp.TCPConnector(limit=connections, limit_per_host=connections,
                                         keepalive_timeout=KEEPALIVE_EXPIRY_S)
        async with aiohttp.ClientSession(base_url=url, connector=connector,
                                         timeout=aiohttp.ClientTimeout(total=600)) as session:
            async def post(path, body):
                async with session.post(path, json=body) as r:
                    if r.status != 200:
                        raise RuntimeError(f"{path}: HTTP {r.status}: {(await r.text())[:300]}")
                    return await r.json()
            yield post
    else:
        import httpx

        limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections,
                              keepalive_expiry=KEEPALIVE_EXPIRY_S)
        async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
            async def post(path, body):
                r = await client.post(path, json=body)
                r.raise_for_status()
                return r.json()
            yield post


def cpu_reading(server_pid: int) -> tuple[dict, dict, float]:
    """Each server process's (`comm:pid`: the API server, vLLM's engine core, a worker) and each
    API-process thread's user+system seconds so far, and this process's own: two readings around
    P1's timed bursts give `benchmarks/diag/serve_cpu.py`'s figures without another server start."""
    from benchmarks.diag.serve_cpu import _cpu, _tree

    procs = {}
    for p in _tree(server_pid):
        comm, sec = _cpu(str(p))
        procs[f"{comm}:{p}"] = sec
    threads = {t: _cpu(f"{server_pid}/task/{t}")[1] for t in os.listdir(f"/proc/{server_pid}/task")}
    return procs, threads, time.process_time()


def cpu_per_request(before: tuple, after: tuple, n: int, top: int | None = 6) -> dict:
    """µs of CPU per request between two `cpu_reading`s over `n` requests (the `top` busiest
    threads; None: all that ran)."""
    us = lambda a, b: round((a - b) / n * 1e6, 1)  # noqa: E731
    return {"us_cpu_per_req": {k: us(v, before[0].get(k, 0.0)) for k, v in after[0].items()},
            "api_threads_us": sorted((us(v, before[1][t]) for t, v in after[1].items()
                                      if t in before[1] and v > before[1][t]), reverse=True)[:top],
            "client_us_per_req": us(after[2], before[2])}


def burst_cpu(before: tuple, after: tuple, n: int) -> list[float]:
    """One burst's µs of CPU per request: [API process, its busiest thread (the event loop), the
    next (causalboard's engine-loop thread), the rest of the server's processes (engine core,
    workers)]."""
    d = cpu_per_request(before, after, n, top=2)
    procs = list(d["us_cpu_per_req"].values())
    threads = d["api_threads_us"] + [0.0, 0.0]
    return [procs[0], threads[0], threads[1], round(sum(procs[1:]), 1)]


async def run_tasks(url: str, name: str, args, server_pid: int | None = None) -> None:
    async with http_client(url, args.client, args.p1_requests + 8) as client:
        tasks = args.tasks.split(",")
        hi = args.vocab_hi
        if "p1" in tasks:
            rng = random.Random(0)
            prompt = [rng.randrange(4, hi) for _ in range(16)]
            prompts = [prompt] * args.p1_requests
            await burst(client, name, prompts, 1)  # warm-up
            ts, per_burst, readings = [], [], [cpu_reading(server_pid)] if server_pid else []
            for _ in range(args.reps):
                ts.append(await burst(client, name, prompts, 1))
                if server_pid:  # outside the timed burst: each burst's CPU too (the fast and slow ones differ)
                    readings.append(cpu_reading(server_pid))
                    per_burst.append(burst_cpu(readings[-2], readings[-1], len(prompts)))
            cpu = cpu_per_request(readings[0], readings[-1], args.reps * len(prompts)) if readings else {}
            m = statistics.median(ts)
            emit(f"http_{args.server}", task="p1", requests=len(prompts), req_per_s=round(len(prompts) / m, 1),
                 median_s=round(m, 4), reps_s=[round(x, 4) for x in ts], client=args.client, **cpu,
                 **({"burst_cpu_us": per_burst} if per_burst else {}))
        if "p2" in tasks:
            for batch in (32, 1):
                rng = random.Random(100 + batch)
                prompts = [[rng.randrange(4, hi) for _ in range(16)] for _ in range(batch)]
                await burst(client, name, prompts, 8)  # warm-up
                ts = [await burst(client, name, prompts, args.tokens) for _ in range(args.reps)]
                m = statistics.median(ts)
                emit(f"http_{args.server}", task="p2", batch=batch, tokens=args.tokens,
                     out_tok_per_s=round(batch * args.tokens / m, 1), median_s=round(m, 4), reps_s=[round(x, 4) for x in ts],
                     client=args.client)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--server", choices=["stock", "cb"], required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--tasks", default="p1,p2")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--p1-requests", type=int, default=768)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--start-timeout", type=float, default=600)
    ap.add_argument("--server-args", default="",
                    help="extra arguments for the server's command line, one string (e.g. '--multiprocess' for cb)")
    ap.add_argument("--client", choices=["aiohttp", "httpx"], default="aiohttp",
                    help="the benchmark's HTTP client (httpx: the client of the calls before 2026-11-28's eighteenth session)")
    ap.add_argument("--fallback-wheels", default=None,
                    help="either server: wheels (scripts/gpu/server_extra.sh) of packages vLLM's server imports that this "
                         "interpreter may lack; unpacked under /tmp and searched after site-packages")
    args = ap.parse_args()
    with open(Path(args.model) / "config.json") as f:
        args.vocab_hi = min(int(json.load(f)["vocab_size"]) - 1, 128000)
    from app.client.notebook import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    t0 = time.perf_counter()
    fallback = unpack_fallback(args.fallback_wheels) if args.fallback_wheels else None
    if fallback:  # the client may need them too (aiohttp), after this interpreter's own packages
        sys.path.append(fallback)
    cmd = server_command(args.server, args.model, args.device, port, fallback) + shlex.split(args.server_args)
    proc = subprocess.Popen(cmd, env=env, cwd=REPO)
    try:
        name = wait_ready(url, proc, args.start_timeout)
        emit(f"http_{args.server}", step="ready", seconds=round(time.perf_counter() - t0, 1), model=name,
             fallback=fallback is not None)
        asyncio.run(run_tasks(url, name, args, proc.pid if os.path.isdir(f"/proc/{proc.pid}") else None))
    finally:
        stop_server(proc)


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM (both servers shut down cleanly on it), then SIGKILL after 60 s."""
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


if __name__ == "__main__":
    main()

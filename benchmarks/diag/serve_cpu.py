"""CPU time per request of each process of a server (and each thread of its API process) over P1's
bursts over HTTP (issue 13: `causalboard serve` against `vllm serve`, where does a completion's
host time go):

    python3 benchmarks/diag/serve_cpu.py --server cb --model /tmp/cpuhost --server-args "--multiprocess --compiled"
    python3 benchmarks/diag/serve_cpu.py --server stock --model /tmp/cpuhost --server-args "--gpu-memory-utilization 0.5"
    python3 benchmarks/diag/serve_cpu.py --server cb --repo /tmp/old-tree ...   # the server of another tree

Starts the server as `benchmarks/compare/http_bench.py` does (`--repo`: the tree whose server
runs; the harness is this tree's), sends two warm-up bursts of `--requests` one-token completions
of one 16-token prompt (aiohttp client), then `--bursts` timed ones, and reads each process's and
each API-process thread's user+system time from /proc before and after. One JSON line:
`bursts_s`, `us_cpu_per_req` per process (`comm:pid`: the API server, vLLM's engine core, a
worker), `api_threads_us` (the API process's threads, largest first: its event loop first, then
causalboard's engine-loop thread), `client_us_per_req`, `wall_us_per_req`. `--py-spy BINARY`
samples the API process during the timed bursts (`py-spy record --gil --threads`, raw collapsed
stacks to `--py-spy-out`): where its GIL-holding time goes. On a 2-core machine the
client shares the cores: compare servers in alternating runs.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(HERE))


def _tree(pid: int) -> list[int]:
    """`pid` and its descendants (children of any of its threads)."""
    out = [pid]
    task_dir = f"/proc/{pid}/task"
    for t in os.listdir(task_dir) if os.path.isdir(task_dir) else []:
        try:
            for c in open(f"{task_dir}/{t}/children").read().split():
                out += _tree(int(c))
        except OSError:
            pass
    return out


def _cpu(path: str) -> tuple[str | None, float]:
    """(comm, user+system seconds) of /proc/`path` (a pid, or `pid/task/tid`)."""
    try:
        fields = open(f"/proc/{path}/stat").read().rsplit(")", 1)[1].split()
        return open(f"/proc/{path}/comm").read().strip(), (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except OSError:
        return None, 0.0


def main() -> None:
    from app.client.notebook import free_port
    from benchmarks.compare.http_bench import (burst, cpu_per_request, cpu_reading, http_client, server_command, stop_server,
                                               wait_ready)

    ap = argparse.ArgumentParser()
    ap.add_argument("--server", choices=["stock", "cb"], required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--repo", default=str(HERE), help="the tree whose server runs (default: this one)")
    ap.add_argument("--requests", type=int, default=768)
    ap.add_argument("--bursts", type=int, default=3)
    ap.add_argument("--server-args", default="")
    ap.add_argument("--py-spy", default="", help="a py-spy binary: sample the API process during the timed bursts "
                    "(`--gil --threads`, raw collapsed stacks to --py-spy-out)")
    ap.add_argument("--py-spy-out", default="serve-pyspy.txt")
    args = ap.parse_args()
    with open(Path(args.model) / "config.json") as f:
        hi = min(int(json.load(f)["vocab_size"]) - 1, 128000)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [args.repo, os.environ.get("PYTHONPATH")]))}
    cmd = server_command(args.server, args.model, args.device, port) + shlex.split(args.server_args)
    proc = subprocess.Popen(cmd, env=env, cwd=args.repo, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        name = wait_ready(url, proc, 600)

        async def go() -> dict:
            async with http_client(url, "aiohttp", args.requests + 8) as post:
                rng = random.Random(0)
                prompts = [[rng.randrange(4, hi) for _ in range(16)]] * args.requests
                for _ in range(2):
                    await burst(post, name, prompts, 1)
                spy = None
                if args.py_spy:
                    spy = subprocess.Popen([args.py_spy, "record", "--pid", str(proc.pid), "--gil", "--threads", "--rate", "250",
                                            "--format", "raw", "--output", args.py_spy_out, "--nonblocking"],
                                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                    await asyncio.sleep(1.0)
                before, t0 = cpu_reading(proc.pid), time.perf_counter()
                times = [await burst(post, name, prompts, 1) for _ in range(args.bursts)]
                wall, after = time.perf_counter() - t0, cpu_reading(proc.pid)
                if spy is not None:
                    spy.send_signal(signal.SIGINT)
                    spy.wait(30)
            n = args.bursts * args.requests
            return {"bench": "serve_cpu", "server": args.server, "repo": args.repo, "bursts_s": [round(t, 3) for t in times],
                    **cpu_per_request(before, after, n, top=None), "wall_us_per_req": round(wall / n * 1e6, 1)}

        print(json.dumps(asyncio.run(go())), flush=True)
    finally:
        stop_server(proc)


if __name__ == "__main__":
    main()

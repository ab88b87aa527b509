"""The CPU's "slow mode" (issue #13): an in-process CPU engine's speed with and without one busy
neighbour process, for its default intra-op thread count (one core to spare:
`runtime.cpu_thread_count`) and for as many threads as cores (the old default).

    PYTHONPATH=. python3 benchmarks/diag/cpu_contention.py [--rounds 2] [--out FILE]

Each (threads, load) pair runs in a fresh process, the pairs alternating, `--rounds` times. A
process starts `load` busy loops (`while True: pass`, one core each), starts the engine (bundled
model) and measures: decode (8 x 48 tokens, ignore_eos; best of 3) and a burst of 256 distinct
16-token one-token requests (median of 3). One JSON line per process (`bench: cpu_contention`),
printed and appended to `--out`.
"""
import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time


def measure(threads: int | None, load: int) -> dict:
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(load)]
    try:
        import torch

        from engine_ext import Engine, GenerationParams

        eng = Engine(device="cpu", cpu_threads=threads).start()
        try:
            decode = []
            for _ in range(3):
                t = time.perf_counter()
                gens = eng.generate(["The capital of"] * 8, GenerationParams(max_tokens=48, ignore_eos=True))
                decode.append(sum(len(g.token_ids) for g in gens) / (time.perf_counter() - t))
            rng = random.Random(0)
            prompts = [[rng.randrange(4, eng.info.vocab_size) for _ in range(16)] for _ in range(256)]
            burst = []
            for _ in range(3):
                t = time.perf_counter()
                eng.generate(prompts, GenerationParams(max_tokens=1))
                burst.append(len(prompts) / (time.perf_counter() - t))
            return {"bench": "cpu_contention", "threads_setting": threads or "default", "torch_threads": torch.get_num_threads(),
                    "cores": len(os.sched_getaffinity(0)), "busy_neighbours": load,
                    "decode_tok_s": round(max(decode), 1), "decode_all": [round(x, 1) for x in decode],
                    "burst_req_s": round(statistics.median(burst), 1), "burst_all": [round(x, 1) for x in burst],
                    "load_avg": os.getloadavg()[0]}
        finally:
            eng.close()
    finally:
        for p in busy:
            p.kill()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=None)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # "threads,load": run one process's measurement
    args = ap.parse_args()
    if args.one:
        t, load = args.one.split(",")
        print(json.dumps(measure(int(t) or None, int(load))), flush=True)
        return
    cores = len(os.sched_getaffinity(0))
    for rnd in range(args.rounds):
        for threads in (0, cores):  # 0: the engine's default
            for load in (0, 1):
                proc = subprocess.run([sys.executable, __file__, "--one", f"{threads},{load}"], capture_output=True, text=True,
                                      env={k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"})
                lines = [ln for ln in proc.stdout.splitlines() if ln.startswith('{"bench"')]
                if proc.returncode or not lines:
                    print(proc.stderr[-2000:], file=sys.stderr)
                    raise SystemExit(f"round {rnd}, threads {threads}, load {load}: failed")
                row = {**json.loads(lines[-1]), "round": rnd}
                print(json.dumps(row), flush=True)
                if args.out:
                    with open(args.out, "a") as f:
                        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
